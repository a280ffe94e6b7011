// fido-bench net-apps: node's http client against node_server.js.
//   node_client.js PORT SECS POSTS
// GETs over one keep-alive connection for SECS seconds, then POSTS 4 MiB
// bodies; checks every answer; prints a JSON line.
const http = require('http'), crypto = require('crypto');
const [port, secs, posts] = process.argv.slice(2).map(Number);
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
const body = Buffer.alloc(4 << 20);
for (let i = 0; i < body.length; i++) body[i] = (i * 2654435761 >>> 24) & 255;
const bodySha = crypto.createHash('sha256').update(body).digest('hex');
const empty = crypto.createHash('sha256').digest('hex');
function request(method, path, data) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, path, method, agent }, res => {
      let s = ''; res.setEncoding('utf8');
      res.on('data', c => s += c); res.on('end', () => resolve(s));
    });
    req.on('error', reject);
    req.end(data);
  });
}
(async () => {
  let bad = 0, gets = 0;
  const t0 = process.hrtime.bigint();
  const limit = BigInt(Math.round(secs * 1e9));
  while (process.hrtime.bigint() - t0 < limit) {
    const path = `/g${gets}`;
    if (await request('GET', path) !== `GET ${path} 0 ${empty}\n`) bad++;
    gets++;
  }
  const getS = Number(process.hrtime.bigint() - t0) / 1e9;
  const t1 = process.hrtime.bigint();
  for (let i = 0; i < posts; i++) {
    if (await request('POST', '/p', body) !== `POST /p ${body.length} ${bodySha}\n`) bad++;
  }
  const postS = Number(process.hrtime.bigint() - t1) / 1e9;
  agent.destroy();
  console.log(JSON.stringify({ gets, get_s: getS, posts, post_bytes: posts * body.length, post_s: postS, bad }));
  process.exitCode = bad ? 1 : 0;
})();
