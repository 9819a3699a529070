"""SGLang wire-protocol pieces without a cluster: the bodies SGLang's router sends (as
captured from sglang-router 0.3.2), batched bodies, the bootstrap lookup's errors, and the
`--disaggregation-bootstrap-port` flag's checks."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from pdserve.http.errors import ApiError
from pdserve.http.protocol import ChatBody, CompletionBody, GenerateBody
from pdserve.node.sglang_bootstrap_peer import BootstrapPeers, bootstrap_url
from pdserve.ports import refusing_port

LEG = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8999, "bootstrap_room": 12345}
# What sglang-router 0.3.2 posts to both workers for a client's /generate.
ROUTER_GENERATE = {"model": None, "input_ids": [1, 2], "return_text_in_logprobs": False,
                   "stream": True, "log_metrics": True, "return_hidden_states": False,
                   "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False, **LEG}
ROUTER_CHAT = {"messages": [{"role": "user", "content": "hi"}], "model": "m",
               "logprobs": False, "max_completion_tokens": 3, "stream": False,
               "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False, **LEG}


def test_router_bodies_are_accepted_with_their_leg_fields():
    g = GenerateBody.model_validate(ROUTER_GENERATE)
    g.validate_input()
    assert g.leg_fields() == LEG
    assert ChatBody.model_validate(ROUTER_CHAT).leg_fields() == LEG
    c = CompletionBody.model_validate({"model": "m", "prompt": "hi", "echo": False, **LEG})
    assert c.leg_fields() == LEG


@pytest.mark.parametrize("body", [
    [{"text": "a"}],
    {"text": ["a", "b"]},
    {"input_ids": [[1, 2], [3]]},
    {"input_ids": [1, 2], "bootstrap_room": [1, 2]},
    {"input_ids": [1, 2], "bootstrap_host": ["h", "h"]},
])
def test_batched_generate_bodies_are_a_clear_400(body):
    with pytest.raises(ApiError) as e:
        GenerateBody.model_validate(body)
    assert e.value.status == 400 and "batched requests are not supported" in e.value.message


def test_batched_completion_prompts_on_a_leg_are_a_clear_400():
    """A client's batch of prompts is served; on a PD leg (one bootstrap room) it cannot be."""
    CompletionBody.model_validate({"model": "m", "prompt": [[1, 2], [3]]})
    with pytest.raises(ApiError, match="batched"):
        CompletionBody.model_validate({"model": "m", "prompt": [[1, 2], [3]], **LEG})


@pytest.mark.parametrize("flag", ["return_hidden_states", "return_entropy", "background"])
def test_sglang_features_pdserve_lacks_are_400_only_when_asked_for(flag):
    GenerateBody.model_validate({"text": "a", flag: False}).validate_input()
    with pytest.raises(ApiError, match=flag):
        GenerateBody.model_validate({"text": "a", flag: True}).validate_input()


def test_sglang_return_logprob_is_supported():
    body = GenerateBody.model_validate({"text": "a", "return_logprob": True,
                                        "top_logprobs_num": 2, "logprob_start_len": 0})
    body.validate_input()
    assert body.logprob_params(3) == {"logprobs": 2, "prompt_logprobs": 2}


@pytest.mark.parametrize("bad", [{"bootstrap_port": 0}, {"bootstrap_port": "8999"},
                                 {"bootstrap_host": ""}, {"bogus": 1}])
def test_bad_leg_fields_and_unknown_fields_are_refused(bad):
    with pytest.raises(ValueError):
        GenerateBody.model_validate({"text": "a", **bad})


def test_bootstrap_url_brackets_ipv6():
    assert bootstrap_url("::1", 8999) == "http://[::1]:8999/bootstrap"
    assert bootstrap_url("10.0.0.2", 8999) == "http://10.0.0.2:8999/bootstrap"


def test_unreachable_bootstrap_address_is_503():
    with pytest.raises(ApiError) as e:
        with refusing_port() as port:
            asyncio.run(BootstrapPeers(timeout_s=2).lookup("127.0.0.1", port))
    assert e.value.status == 503 and "unreachable" in e.value.message
    assert e.value.code == "prefill_node_unavailable"


def _node(role: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", role, "--model", "tiny-llama",
                           "--registry", "http://127.0.0.1:9", "--port", "0",
                           *flags], capture_output=True, text=True, timeout=120)


def test_bootstrap_port_flag_is_refused_on_decode_and_when_taken():
    r = _node("decode", "--disaggregation-bootstrap-port", "8999")
    assert r.returncode != 0 and "prefill node flag" in r.stderr, r.stderr
    r = _node("prefill", "--disaggregation-bootstrap-port", "70000")
    assert r.returncode != 0 and "0..65535" in r.stderr, r.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        r = _node("prefill", "--disaggregation-bootstrap-port", str(held.getsockname()[1]),
                  "--transfer-backend", "tcp")
    assert r.returncode != 0 and "already in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_sglang_router_defaults_are_accepted_other_values_named():
    """SGLang's router sends its own extensions on every OpenAI body; at their defaults they
    ask for nothing, another value asks for a feature pdserve lacks (a 400 naming it)."""
    sent = {"no_stop_trim": False, "skip_special_tokens": True, "separate_reasoning": True,
            "stream_reasoning": True, "continue_final_message": False,
            "return_hidden_states": False, "lora_path": None}
    ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                             **sent, **LEG})
    with pytest.raises(ApiError, match="skip_special_tokens"):
        CompletionBody.model_validate({"model": "m", "prompt": "a",
                                       "skip_special_tokens": False})
