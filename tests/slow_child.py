"""A child process for ChildProcess tests: it answers each message with the same text, `delay` seconds
later (the first argument), as a worker answers a long step."""

from __future__ import annotations

import argparse
import time

import msgspec
import zmq

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("delay", type=float)
    parser.add_argument("--address", required=True)
    args = parser.parse_args()
    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(args.address)
    while True:
        text = msgspec.msgpack.decode(sock.recv(), type=str)
        time.sleep(args.delay)
        sock.send(msgspec.msgpack.encode(text))
        if text == "bye":
            break
