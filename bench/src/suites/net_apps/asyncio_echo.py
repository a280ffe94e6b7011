"""fido-bench net-apps: python asyncio, many connections, request/response.
  asyncio_echo.py server PORT
  asyncio_echo.py client PORT CONNS ROUNDS SIZE
The client opens CONNS connections, then ROUNDS times sends SIZE bytes on
each (all at once) and reads them back; prints a JSON line."""
import asyncio, json, os, resource, sys, time

# Both systems get the same descriptor budget: the hard limit.
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

async def echo(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()

async def server(port):
    srv = await asyncio.start_server(echo, "127.0.0.1", port, backlog=4096)
    async with srv:
        await srv.serve_forever()

async def client(port, conns, rounds, size):
    t0 = time.perf_counter()
    pairs = await asyncio.gather(*[asyncio.open_connection("127.0.0.1", port) for _ in range(conns)])
    t_open = time.perf_counter() - t0
    bad = 0
    async def one(i, r, w, k):
        msg = bytes([(i * 7 + k + j) & 255 for j in range(16)]) * (size // 16)
        w.write(msg)
        await w.drain()
        got = await r.readexactly(len(msg))
        return got == msg
    t1 = time.perf_counter()
    for k in range(rounds):
        oks = await asyncio.gather(*[one(i, r, w, k) for i, (r, w) in enumerate(pairs)])
        bad += oks.count(False)
    t_rounds = time.perf_counter() - t1
    for _, w in pairs:
        w.close()
    await asyncio.gather(*[w.wait_closed() for _, w in pairs], return_exceptions=True)
    print(json.dumps({"conns": conns, "rounds": rounds, "size": size, "open_s": t_open,
                      "rounds_s": t_rounds, "bad": bad}))
    return bad

if sys.argv[1] == "server":
    asyncio.run(server(int(sys.argv[2])))
else:
    sys.exit(1 if asyncio.run(client(*map(int, sys.argv[2:6]))) else 0)
