"""The engine's outbox: a step's outputs wait until the next step is on the worker, and nothing the engine answers
overtakes what it produced before."""

from __future__ import annotations

import msgspec
import zmq

from pdserve.engine.messages import EngineOutputs, RequestOutput, UtilityResult
from pdserve.engine.outbox import Outbox


def test_held_outputs_go_out_together_and_before_a_utility_answer() -> None:
    ctx = zmq.Context()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    receiver.bind("inproc://outbox")
    sender.connect("inproc://outbox")
    decoder = msgspec.msgpack.Decoder(EngineOutputs | UtilityResult)
    try:
        box = Outbox(sender)
        box.add([RequestOutput("a", [1])])
        box.add([RequestOutput("b", [2])])
        assert not receiver.poll(50)  # held until sent
        box.answer(UtilityResult(call_id=7, result={"idle": True}))
        first, second = decoder.decode(receiver.recv()), decoder.decode(receiver.recv())
        assert isinstance(first, EngineOutputs) and [o.request_id for o in first.outputs] == ["a", "b"]
        assert isinstance(second, UtilityResult) and second.call_id == 7
        box.send()  # nothing held: nothing sent
        assert not receiver.poll(50)
    finally:
        sender.close(0)
        receiver.close(0)
        ctx.term()
