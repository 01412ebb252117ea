"""Times every request of N keep-alive connections to the axum example for D seconds.

Usage: python3 stalled_redis_client.py PORT SECONDS CONNECTIONS
Prints the count, p50, p99 and max, then each request over 10 ms: when it started (s
since the start), how long it took, its status. A direct measure beside wrk's.
"""

import socket
import sys
import threading
import time

port, duration, connections = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: demo-pro-key\r\n\r\n"
answers, lock, start = [], threading.Lock(), time.time()


def connection():
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader, mine = sock.makefile("rb"), []
    while time.time() - start < duration:
        sent = time.time()
        sock.sendall(REQUEST)
        status, length = reader.readline()[9:12].decode(), 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        reader.read(length)
        mine.append((sent - start, time.time() - sent, status))
    with lock:
        answers.extend(mine)


threads = [threading.Thread(target=connection) for _ in range(connections)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
answers.sort()
took = sorted(a[1] for a in answers)
print(
    f"requests {len(took)}, p50 {took[len(took) // 2] * 1e3:.2f} ms, "
    f"p99 {took[int(len(took) * 0.99)] * 1e3:.2f} ms, max {took[-1] * 1e3:.1f} ms"
)
slow = [a for a in answers if a[1] > 0.01]
print(f"over 10 ms: {len(slow)}")
for began, lasted, status in slow:
    print(f"  at {began:.3f} s: {lasted * 1e3:.1f} ms, {status}")
