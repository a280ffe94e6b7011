// fido-bench net-apps: node's http server; answers "<method> <url> <bytes> <sha256>".
const http = require('http'), crypto = require('crypto');
http.createServer((req, res) => {
  const h = crypto.createHash('sha256'); let n = 0;
  req.on('data', c => { h.update(c); n += c.length; });
  req.on('end', () => res.end(`${req.method} ${req.url} ${n} ${h.digest('hex')}\n`));
}).listen(+process.argv[2], '127.0.0.1');
