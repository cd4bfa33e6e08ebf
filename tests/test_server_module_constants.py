"""No mutable module globals in the server: constants are frozen, and request templates are built fresh."""

from __future__ import annotations

import importlib
import pkgutil

import kserve.server


def test_server_modules_hold_no_mutable_globals():
    mutable = []
    for info in pkgutil.iter_modules(kserve.server.__path__):
        module = importlib.import_module(f"kserve.server.{info.name}")
        for name, value in vars(module).items():
            if not name.startswith("__") and isinstance(value, (dict, list, set, bytearray)):
                mutable.append(f"{info.name}.{name}: {type(value).__name__}")
    assert not mutable, mutable


def test_live_self_check_request_is_fresh_each_time():
    from kserve.server.self_check import live_request

    first = live_request("m")
    # Request handling keeps references into the body (tool dicts go to the prompt as sent); any change
    # there must not reach the next self-check.
    first["tools"][0]["function"]["parameters"]["required"].append("city")
    first["messages"][0]["content"] = "changed"
    second = live_request("m")
    assert second["tools"][0]["function"]["parameters"]["required"] == ["unit"]
    assert second["messages"][0]["content"] == "Weather in Paris?"
    assert second["model"] == "m"
