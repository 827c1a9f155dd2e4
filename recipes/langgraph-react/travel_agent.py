"""A LangGraph ReAct travel planner that runs inside a forkd guest (recipes/langgraph-react).

The graph is the classic ReAct loop: a ``model`` node asks an OpenAI-compatible
chat-completions endpoint what to do next (with the tools' JSON schemas), a ``tools`` node
runs the tool calls it returned, and the loop ends when the model answers without one. The
tools run here, in the guest, on the small deterministic tables below (no network).

Where the model is: the stock ``openai`` client's own settings, read when a request is made
(not when the graph is compiled, so the warm snapshot holds no endpoint or key):
``OPENAI_BASE_URL`` (default ``https://api.openai.com/v1``), ``OPENAI_API_KEY`` (in a forkd
sandbox with egress, a placeholder that the host's proxy swaps for the real key),
``HTTPS_PROXY`` and ``SSL_CERT_FILE``; ``TRAVEL_MODEL`` names the model (default
``gpt-4o-mini``).

The agent's state lives in this process's memory, in LangGraph's ``InMemorySaver``, under
one thread id per trip. That is what a forkd branch copies: a grandchild forked from the
branch continues the same thread from the same checkpoint.

Used by the branch demo (``forkd demo langgraph``) through the guest agent's ``eval``:

    start(task, steps)   run the loop for its first ``steps`` model calls (each with its
                         tool calls), then stop: the checkpoint waits before the next model call
    steer(hint)          add "Steering hint: HINT" as a user message and run to the answer
    messages()           the thread's messages so far (OpenAI wire format)
"""

from __future__ import annotations

import json
import operator
import os
import time
from collections.abc import Callable
from typing import Annotated, Any, TypedDict

import openai
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

THREAD = {"configurable": {"thread_id": "trip"}}
RECURSION_LIMIT = 40  # graph steps per run: 20 model calls and their tool calls
SYSTEM = (
    "You are a travel planner. Use the tools to look up attractions, the weather and "
    "costs, then write a day-one plan. Follow any steering hint the user gives."
)

# ---------------------------------------------------------------- the tools' data
ATTRACTIONS: dict[str, dict[str, list[str]]] = {
    "kyoto": {
        "highlights": ["Fushimi Inari shrine", "Kinkaku-ji", "Arashiyama bamboo grove",
                       "Nishiki market", "Gion"],
        "temples and tea": ["Kiyomizu-dera", "a tea ceremony in Gion", "Ryoan-ji rock garden",
                            "Daitoku-ji sub-temples"],
        "quiet": ["the Philosopher's Path", "Ginkaku-ji", "Honen-in"],
        "free": ["Fushimi Inari shrine", "the Kamo riverbank", "Nishiki market (browsing)"],
    },
    "lisbon": {
        "highlights": ["Belem tower", "Alfama", "Tram 28", "LX Factory"],
        "quiet": ["Jardim da Estrela", "the Gulbenkian garden"],
        "free": ["Miradouro da Graca", "Alfama's lanes"],
    },
}
WEATHER: dict[str, list[str]] = {
    "kyoto": ["sunny, 24 C", "light rain, 19 C", "cloudy, 21 C"],
    "lisbon": ["sunny, 27 C", "windy, 22 C", "sunny, 25 C"],
}
DAILY_USD: dict[str, dict[str, int]] = {
    "kyoto": {"lodging": 90, "food": 45, "transport": 12, "tickets": 20},
    "lisbon": {"lodging": 80, "food": 40, "transport": 8, "tickets": 15},
}


def _city(city: str) -> str:
    key = str(city).strip().lower()
    if key not in ATTRACTIONS:
        raise ValueError(f"no data for {city!r}; known cities: {', '.join(sorted(ATTRACTIONS))}")
    return key


def attractions(city: str, theme: str = "highlights") -> str:
    """The city's attractions for a theme."""
    themes = ATTRACTIONS[_city(city)]
    places = themes.get(str(theme).lower(), themes["highlights"])
    return f"{city} ({theme}): " + ", ".join(places)


def weather(city: str, day: int = 1) -> str:
    """The forecast for day N of the trip."""
    days = WEATHER[_city(city)]
    n = int(day)
    if not 1 <= n <= len(days):
        raise ValueError(f"the forecast covers days 1 to {len(days)}, not {day}")
    return f"{city} day {n}: {days[n - 1]}"


def budget(city: str, days: int = 1, limit_usd: int | None = None) -> str:
    """The cost of N days, and what fits under a daily limit when one is given."""
    costs = DAILY_USD[_city(city)]
    n = int(days)
    if not 1 <= n <= 30:
        raise ValueError(f"days must be 1 to 30, not {days}")
    per_day = sum(costs.values())
    text = f"{city}: about ${per_day} a day, ${per_day * n} for {n} day(s)"
    if limit_usd is not None:
        left = int(limit_usd) - costs["transport"] - costs["food"] // 2
        text += (f"; under ${int(limit_usd)} a day: a hostel or day trip, a bus pass "
                 f"(${costs['transport']}), bento meals, ${max(left, 0)} left for tickets")
    return text


TOOLS: dict[str, Callable[..., str]] = {
    "attractions": attractions, "weather": weather, "budget": budget}


def _spec(name: str, description: str, props: dict[str, Any],
          required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


TOOL_SPECS = [
    _spec("attractions", "Attractions of a city for a theme (highlights, temples and tea, "
          "quiet, free).", {"city": {"type": "string"}, "theme": {"type": "string"}}, ["city"]),
    _spec("weather", "The weather forecast for day N of the trip.",
          {"city": {"type": "string"}, "day": {"type": "integer"}}, ["city", "day"]),
    _spec("budget", "Daily costs for N days, optionally under a daily limit in USD.",
          {"city": {"type": "string"}, "days": {"type": "integer"},
           "limit_usd": {"type": "integer"}}, ["city", "days"]),
]


# ---------------------------------------------------------------- the graph
class State(TypedDict):
    messages: Annotated[list[dict[str, Any]], operator.add]


CALLS: list[dict[str, Any]] = []  # this process's model calls: seconds and finish reason


def _client() -> openai.OpenAI:
    # The stock client with its own environment settings, made per call: a fork inherits
    # no connection, and the endpoint and key are whatever the sandbox has now.
    return openai.OpenAI(max_retries=0, timeout=120.0)


def call_model(state: State) -> dict[str, Any]:
    t0 = time.monotonic()
    with _client() as client:
        reply = client.chat.completions.create(
            model=os.environ.get("TRAVEL_MODEL", "gpt-4o-mini"),
            messages=state["messages"],  # type: ignore[arg-type]
            tools=TOOL_SPECS,  # type: ignore[arg-type]
        )
    choice = reply.choices[0]
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    calls = [c for c in choice.message.tool_calls or () if c.type == "function"]
    if calls:  # this graph's tools are all functions (a "custom" tool call is not one)
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls
        ]
    CALLS.append({"s": round(time.monotonic() - t0, 4), "finish": choice.finish_reason})
    return {"messages": [message]}


def run_tools(state: State) -> dict[str, Any]:
    out = []
    for call in state["messages"][-1].get("tool_calls", []):
        name = call["function"]["name"]
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
            tool = TOOLS[name]
            content = tool(**args)
        except Exception as e:  # the model gets the error back, as ReAct agents do
            content = f"error: {type(e).__name__}: {e}"
        out.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return {"messages": out}


def route(state: State) -> str:
    return "tools" if state["messages"][-1].get("tool_calls") else END


def build_graph() -> Any:
    graph = StateGraph(State)
    graph.add_node("model", call_model)
    graph.add_node("tools", run_tools)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, {"tools": "tools", END: END})
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=InMemorySaver())


GRAPH = build_graph()


# ---------------------------------------------------------------- the demo's entry points
def messages() -> list[dict[str, Any]]:
    state = GRAPH.get_state(THREAD)
    return list(state.values.get("messages", []))


def start(task: str, steps: int) -> dict[str, Any]:
    """Run the loop for its first ``steps`` model calls and their tools, then stop."""
    if messages():
        raise RuntimeError("this trip has started already; fork a fresh sandbox for another")
    t0 = time.monotonic()
    inputs: dict[str, Any] | None = {"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]}
    for _ in range(steps):
        GRAPH.invoke(inputs, {**THREAD, "recursion_limit": RECURSION_LIMIT},
                     interrupt_after=["tools"])
        inputs = None  # resume from the checkpoint
        if not GRAPH.get_state(THREAD).next:
            break  # the model answered already
    return {"messages": messages(), "seconds": round(time.monotonic() - t0, 4),
            "next": list(GRAPH.get_state(THREAD).next)}


def steer(hint: str) -> dict[str, Any]:
    """Give the paused loop a steering hint and run it to its answer."""
    t0 = time.monotonic()
    before = len(CALLS)
    GRAPH.update_state(THREAD, {"messages": [
        {"role": "user", "content": f"Steering hint: {hint}"}]}, as_node="tools")
    GRAPH.invoke(None, {**THREAD, "recursion_limit": RECURSION_LIMIT})
    history = messages()
    return {"answer": history[-1].get("content") or "", "messages": history,
            "model_calls": len(CALLS) - before, "seconds": round(time.monotonic() - t0, 4)}
