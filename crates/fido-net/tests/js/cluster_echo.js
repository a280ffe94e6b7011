// Node's `cluster` with round-robin scheduling (Linux's default): the
// primary accepts every connection and hands the socket to a worker over
// its IPC channel (SCM_RIGHTS). Each worker echoes until EOF.
//   node cluster_echo.js PORT WORKERS   prints "listening" once all listen
const cluster = require('node:cluster');
const net = require('node:net');
const port = Number(process.argv[2]);
const workers = Number(process.argv[3] || 2);
cluster.schedulingPolicy = cluster.SCHED_RR;
if (cluster.isPrimary) {
  let ready = 0;
  cluster.on('listening', () => {
    if (++ready === workers) console.log('listening');
  });
  for (let i = 0; i < workers; i++) cluster.fork();
} else {
  net.createServer((s) => s.pipe(s)).listen(port, '127.0.0.1');
}
