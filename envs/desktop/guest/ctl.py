"""Send one request to the desktop's control socket and print its JSON reply (run inside the sandbox).

    python3 ctl.py STATE_DIR '{"op": "act", "action": {"action": "click", "x": 10, "y": 20}}'
"""

import json
import socket
import sys


def main() -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(90)
    try:
        sock.connect(f"{sys.argv[1]}/ctl.sock")
    except OSError as e:
        print(json.dumps({"error": f"the desktop is not running ({e})"}))
        return 3
    sock.sendall(sys.argv[2].encode())
    sock.shutdown(socket.SHUT_WR)
    parts = []
    while chunk := sock.recv(65536):
        parts.append(chunk)
    sys.stdout.write(b"".join(parts).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
