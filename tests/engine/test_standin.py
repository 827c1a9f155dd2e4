"""The stand-in model server against the real, pinned clients (no VMs): the openai client
over HTTPS with a test CA, and the langgraph-react recipe's travel agent on the host."""

from __future__ import annotations

import importlib.util
import json
import ssl
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from forkd.engine.egress.ca import EgressCA
from forkd.engine.egress.standin import TRAVEL_PLAN, Answer, Plan, StandinModel, ToolCall, fill

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "recipes" / "langgraph-react" / "travel_agent.py"
KEY = "sk-test-" + "k" * 24
TASK = "Plan day one of a three-day trip to Kyoto."


@pytest.fixture
def test_ca(tmp_path: Path) -> EgressCA:
    return EgressCA.load_or_create(tmp_path / "ca")


@pytest.fixture
def model(test_ca: EgressCA) -> Iterator[StandinModel]:
    with StandinModel(api_key=KEY, tls=test_ca.leaf_context("127.0.0.1")) as server:
        yield server


def client_for(model: StandinModel, ca: EgressCA, key: str = KEY) -> openai.OpenAI:
    """The stock client, verifying the stand-in's certificate against the test CA only."""
    trust = ssl.create_default_context(cadata=ca.cert_pem.decode())
    return openai.OpenAI(api_key=key, base_url=f"{model.url}/v1", max_retries=0,
                         http_client=openai.DefaultHttpx2Client(verify=trust))


def test_the_openai_client_gets_tool_calls_then_the_answer(
        model: StandinModel, test_ca: EgressCA) -> None:
    client = client_for(model, test_ca)
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    names = []
    for _ in range(3):
        r = client.chat.completions.create(model="standin", messages=messages)  # type: ignore[arg-type]
        call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert r.choices[0].finish_reason == "tool_calls"
        names.append(call.function.name)  # type: ignore[union-attr]
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": f"{names[-1]} ok"}]
    done = client.chat.completions.create(model="standin", messages=messages)  # type: ignore[arg-type]
    assert names == ["attractions", "weather", "budget"]
    assert done.choices[0].finish_reason == "stop"
    text = done.choices[0].message.content or ""
    assert text.startswith("Day one in Kyoto") and "Weather: weather ok" in text
    assert "Cost: budget ok" in text
    assert len(model.completions()) == 4
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in model.completions())


def test_the_openai_client_streams_a_tool_call(model: StandinModel, test_ca: EgressCA) -> None:
    client = client_for(model, test_ca)
    stream = client.chat.completions.create(
        model="standin", messages=[{"role": "user", "content": TASK}], stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].function.name == "attractions"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Kyoto"}  # type: ignore[union-attr,arg-type]


def test_a_wrong_key_is_refused_and_quoted(model: StandinModel, test_ca: EgressCA) -> None:
    client = client_for(model, test_ca, key="sk-wrong-key-123456")
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model="standin", messages=[{"role": "user", "content": "x"}])
    assert "sk-wrong-key-123456" in str(e.value)


def test_an_untrusted_certificate_is_refused(model: StandinModel, tmp_path: Path) -> None:
    other = EgressCA.load_or_create(tmp_path / "other-ca")
    with pytest.raises(openai.APIConnectionError):
        client_for(model, other).chat.completions.create(
            model="standin", messages=[{"role": "user", "content": "x"}])


def test_each_hint_continues_the_same_history_differently() -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": TASK},
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "function": {"name": "attractions", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "temples"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_2", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    firsts = {}
    for hint in ("deep culture", "minimalist", "budget"):
        steered = [*history, {"role": "user", "content": f"Steering hint: {hint}"}]
        firsts[hint] = TRAVEL_PLAN.next_step(steered)
    assert firsts["deep culture"] == ToolCall(
        "attractions", {"city": "Kyoto", "theme": "temples and tea"})
    assert firsts["budget"] == ToolCall("budget", {"city": "Kyoto", "days": 1, "limit_usd": 60})
    minimalist = firsts["minimalist"]
    assert isinstance(minimalist, Answer)
    # the answer quotes the forecast fetched before the hint: it depends on the history
    assert "Weather: sunny" in fill(minimalist.text, history)
    assert TRAVEL_PLAN.next_step(history) == ToolCall("budget", {"city": "Kyoto", "days": 3})


def test_tool_results_are_found_by_the_call_they_answer() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "assistant", "tool_calls": [
            {"id": "a", "function": {"name": "weather"}}, {"id": "b", "function": {"name": "x"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "not weather"},
        {"role": "tool", "tool_call_id": "a", "content": "rain"},
        {"role": "tool", "tool_call_id": "zzz", "content": "orphan"},
    ]
    assert fill("{tool:weather}|{tool:budget}|{last_tool}", msgs) == "rain||orphan"
    # hostile shapes are text, not errors
    assert fill("{tool:weather}", [{"role": "assistant", "tool_calls": "nope"},
                                   {"role": "assistant", "tool_calls": [7, {"function": 1}]}]) == ""


# -- the recipe's agent, on the host ------------------------------------------------------


def load_agent(name: str) -> types.ModuleType:
    """A fresh copy of recipes/langgraph-react/travel_agent.py (its own graph and memory)."""
    spec = importlib.util.spec_from_file_location(name, AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def plain_model(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandinModel]:
    with StandinModel(api_key=KEY) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", f"{server.url}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        monkeypatch.delenv("HTTPS_PROXY", raising=False)
        monkeypatch.delenv("HTTP_PROXY", raising=False)
        yield server


def test_the_agent_stops_after_its_first_steps_and_is_steered(plain_model: StandinModel) -> None:
    agent = load_agent("travel_agent_steered")
    pre = agent.start(TASK, 2)
    assert pre["next"] == ["model"]
    roles = [m["role"] for m in pre["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert pre["messages"][3]["content"].startswith("Kyoto (highlights): Fushimi Inari")
    assert pre["messages"][5]["content"] == "Kyoto day 1: sunny, 24 C"
    assert len(plain_model.completions()) == 2
    out = agent.steer("budget")
    assert out["messages"][: len(pre["messages"])] == pre["messages"]
    assert out["model_calls"] == 2 and len(plain_model.completions()) == 4
    assert out["answer"].startswith("Day one under $60")
    assert "Weather: Kyoto day 1: sunny, 24 C" in out["answer"]
    assert "$26 left for tickets" in out["answer"]  # the guest's budget tool ran
    with pytest.raises(RuntimeError, match="started already"):
        agent.start(TASK, 2)


def test_the_agent_runs_to_its_answer_without_a_hint(plain_model: StandinModel) -> None:
    agent = load_agent("travel_agent_plain")
    out = agent.start(TASK, 10)
    assert out["next"] == []
    assert out["messages"][-1]["content"].startswith("Day one in Kyoto")
    assert len(plain_model.completions()) == 4


def test_tool_errors_go_back_to_the_model() -> None:
    agent = load_agent("travel_agent_tools")
    state = {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "function": {"name": "weather", "arguments": '{"city": "Atlantis"}'}},
        {"id": "2", "function": {"name": "rm", "arguments": "{}"}},
        {"id": "3", "function": {"name": "weather", "arguments": "not json"}},
        {"id": "4", "function": {"name": "budget", "arguments": '{"city": "kyoto", "days": 99}'}},
    ]}]}
    out = [m["content"] for m in agent.run_tools(state)["messages"]]
    assert out[0].startswith("error: ValueError: no data for 'Atlantis'")
    assert out[1].startswith("error: KeyError")
    assert out[2].startswith("error: JSONDecodeError")
    assert "days must be 1 to 30" in out[3]


def test_plans_round_trip_as_json() -> None:
    plan = Plan.from_json({"steps": [{"tool": "weather", "arguments": {"day": 1}},
                                     {"answer": "done {tool:weather}"}],
                           "variants": {"Budget": [{"answer": "cheap"}]}})
    assert plan.steps[1] == Answer("done {tool:weather}")
    assert plan.variants == {"budget": (Answer("cheap"),)}
