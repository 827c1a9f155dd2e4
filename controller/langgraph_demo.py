"""`forkd demo langgraph`: a LangGraph ReAct agent BRANCHED mid-reasoning, steered three ways.

A source sandbox of ``deeplethe/langgraph-react`` (recipes/langgraph-react/) runs the
travel planner's ReAct loop for its first steps: the model asks for Kyoto's attractions,
then day one's weather, and the guest runs both tools. The agent's state (LangGraph's
in-memory checkpoint, the message history) lives in the guest's memory. The source is
BRANCHED; three grandchildren forked from the branch each get a steering hint ("deep
culture", "minimalist", "budget") and run the loop on to their day-one plan.

The model is reached the way an agent in a forkd sandbox reaches any model: through the
child's egress proxy, the only network a child has, with the API key held on the host
(docs/agents.md). Without ``--model-url`` the model is forkd's stand-in
(forkd.engine.egress.standin): a deterministic chat-completions server on the host's
loopback, serving HTTPS with a certificate from a throwaway test CA, requiring a
throwaway key that only the proxy holds; the guest's stock ``openai`` client talks to
``https://model.forkd.test:PORT/v1`` as it would to any API.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from forkd.engine.egress.standin import RecordedRequest, StandinModel
from forkd.errors import ForkdError, InvalidInput, NotFound
from forkd.store.store import Store

DEFAULT_TAG = "deeplethe/langgraph-react:latest"  # what the main job publishes on its hub
RECIPE = "recipes/langgraph-react/recipe.toml"
TASK = "Plan day one of a three-day trip to Kyoto."
HINTS = ("deep culture", "minimalist", "budget")
PRE_BRANCH_STEPS = 2  # model calls (with their tool calls) the source runs before the branch
MODEL_HOST = "model.forkd.test"  # the stand-in's name (.test: never a real host)
EVAL_TIMEOUT = 600.0  # seconds for one agent run in a sandbox (TCG is slow)
Say = Callable[[str], None]


@dataclass(frozen=True)
class ModelEndpoint:
    """Where the guest's client goes: its base URL, the egress entry that lets it, the
    model name, and the host configuration of the forking process (FORKD_* variables the
    egress proxy reads: secret store, upstream CA, address pins)."""

    base_url: str
    allow: str
    model: str
    host_env: Mapping[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def standin_endpoint(work: Path) -> Iterator[tuple[ModelEndpoint, StandinModel]]:
    """The stand-in model on 127.0.0.1 as ``https://model.forkd.test:PORT/v1``, with a
    test CA (trusted by the proxy only: FORKD_EGRESS_UPSTREAM_CA), a fresh API key that
    only the host's secret store (FORKD_SECRETS, in ``work``) holds, bound to it, and the
    name pinned to loopback for the proxy (FORKD_EGRESS_PINS)."""
    from forkd.engine.egress.ca import EgressCA
    from forkd.engine.egress.secrets import SecretStore

    ca = EgressCA.load_or_create(work / "upstream-ca")
    ca_file = work / "upstream-ca.pem"
    ca_file.write_bytes(ca.cert_pem)
    key = "sk-standin-" + secrets.token_hex(24)
    with StandinModel(api_key=key, tls=ca.leaf_context(MODEL_HOST)) as server:
        allow = f"{MODEL_HOST}:{server.port}"
        SecretStore(work / "secrets").set("OPENAI_API_KEY", key, [allow])
        env = {
            "FORKD_SECRETS": str(work / "secrets"),
            "FORKD_EGRESS_UPSTREAM_CA": str(ca_file),
            "FORKD_EGRESS_PINS": f"{MODEL_HOST}=127.0.0.1",
        }
        yield ModelEndpoint(f"https://{allow}/v1", allow, "standin", env), server


def real_endpoint(base_url: str, model: str) -> ModelEndpoint:
    """Any OpenAI-compatible ``https://`` endpoint: egress to its host and port, the key from
    this host's secret store (a secret named OPENAI_API_KEY bound to that destination)."""
    url = urlsplit(base_url)
    if url.scheme != "https" or not url.hostname:
        raise InvalidInput(f"--model-url must be an https:// URL, got {base_url!r}")
    allow = f"{url.hostname}:{url.port or 443}"
    from forkd.engine.egress.policy import parse_destination
    from forkd.engine.egress.secrets import SecretStore

    dest = parse_destination(allow, wildcard_ok=False)
    store = SecretStore()
    try:
        secret = store.get("OPENAI_API_KEY")
    except ForkdError as e:
        raise NotFound(
            f"no secret OPENAI_API_KEY on this host ({e}); run `printenv "
            f"OPENAI_API_KEY | forkd secret set OPENAI_API_KEY --bind {allow}`"
        ) from e
    if not secret.bound_to(dest):
        raise InvalidInput(
            f"the secret OPENAI_API_KEY is not bound to {allow}; run "
            f"`... | forkd secret set OPENAI_API_KEY --bind {allow}`"
        )
    return ModelEndpoint(base_url.rstrip("/"), allow, model)


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """os.environ with ``values`` set (what the egress proxy's settings are read from)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Lane:
    """One grandchild: its hint, when it was ready, how long its run took, what it said."""

    hint: str
    child_id: str
    ready_ms: float
    seconds: float = 0.0
    answer: str = ""
    model_calls: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LanggraphDemoReport:
    tag: str
    branch_tag: str
    source_id: str = ""
    source_ready_ms: float = 0.0
    source_seconds: float = 0.0  # the pre-branch steps in the source
    source_messages: list[dict[str, Any]] = field(default_factory=list)
    branch_pause_ms: float = 0.0
    branch_ms: float = 0.0
    fork_ms: float = 0.0  # three grandchildren, from the fork call to all of them ready
    lanes: list[Lane] = field(default_factory=list)
    requests: list[RecordedRequest] = field(default_factory=list)  # stand-in only
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def ensure_snapshot(store: Store, tag: str, say: Say) -> None:
    """``tag`` in the local store, pulled from the default hub if it is not there yet."""
    from forkd.controller.coding_demo import ensure_snapshot as pull_if_missing

    try:
        pull_if_missing(store, tag, say)
    except NotFound as e:
        raise NotFound(
            f"no snapshot {tag} here and pulling it failed ({e.__cause__}); run the main job "
            "(it publishes deeplethe/langgraph-react on its hub) or "
            f"`forkd build {RECIPE} --tag TAG` and pass --tag TAG"
        ) from e


def _eval(child_id: str, code: str) -> Any:
    from forkd.engine import children as ch

    r = ch.eval_in(child_id, code, timeout=EVAL_TIMEOUT)
    if r.get("error"):
        err = r["error"]
        raise ForkdError(
            f"sandbox {child_id}: {err.get('type')}: {err.get('message')}\n"
            f"{err.get('traceback', '')}"
        )
    return r.get("value")


def _point_at(child_id: str, endpoint: ModelEndpoint) -> None:
    """The guest client's endpoint and model (the key and proxy come with its egress)."""
    env = {"OPENAI_BASE_URL": endpoint.base_url, "TRAVEL_MODEL": endpoint.model}
    _eval(child_id, f"__import__('os').environ.update({json.dumps(env)})")


def _continue(child_id: str, ready_ms: float, hint: str) -> Lane:
    t0 = time.perf_counter()
    out = _eval(child_id, f"travel_agent.steer({hint!r})")
    return Lane(
        hint,
        child_id,
        ready_ms,
        time.perf_counter() - t0,
        str(out["answer"]),
        int(out["model_calls"]),
        list(out["messages"]),
    )


def run(
    store: Store,
    endpoint: ModelEndpoint,
    tag: str = DEFAULT_TAG,
    *,
    say: Say,
    hints: Sequence[str] = HINTS,
    server: StandinModel | None = None,
) -> LanggraphDemoReport:
    """The whole demo; every sandbox it starts is killed and its branch tag removed.
    With ``server`` (the stand-in), its recorded requests go into the report and checks."""
    from forkd.engine import branch as br
    from forkd.engine import children as ch

    t_start = time.perf_counter()
    ensure_snapshot(store, tag, say)
    report = LanggraphDemoReport(tag, f"langgraph-demo:{secrets.token_hex(4)}")
    started: list[str] = []
    try:
        with _environ(endpoint.host_env):
            source = ch.fork(store, tag, 1, egress=[endpoint.allow]).children[0]
            started.append(source.id)
            report.source_id = source.id
            report.source_ready_ms = source.timings_ms.get("ready", 0.0)
            say(
                f"source {source.id} ready in {report.source_ready_ms:.0f} ms; "
                f"egress to {endpoint.allow} only"
            )
            _point_at(source.id, endpoint)
            t0 = time.perf_counter()
            pre = _eval(source.id, f"travel_agent.start({TASK!r}, {PRE_BRANCH_STEPS})")
            report.source_seconds = time.perf_counter() - t0
            report.source_messages = list(pre["messages"])
            say(
                f"source: {PRE_BRANCH_STEPS} ReAct steps in {report.source_seconds:.1f} s "
                f"({len(report.source_messages)} messages; next: {', '.join(pre['next'])})"
            )
            t0 = time.perf_counter()
            branched = br.branch(store, source.id, report.branch_tag)
            report.branch_ms = (time.perf_counter() - t0) * 1000
            report.branch_pause_ms = branched.pause_ms
            say(
                f"BRANCH {report.branch_tag}: source paused {branched.pause_ms:.1f} ms "
                f"({report.branch_ms:.0f} ms in all)"
            )
            t0 = time.perf_counter()
            forked = ch.fork(store, report.branch_tag, len(hints), egress=[endpoint.allow])
            report.fork_ms = (time.perf_counter() - t0) * 1000
            started.extend(c.id for c in forked.children)
            if forked.errors or len(forked.children) != len(hints):
                raise ForkdError("grandchildren failed to start:\n" + "\n".join(forked.errors))
            say(f"{len(hints)} grandchildren ready in {report.fork_ms:.0f} ms")
            with ThreadPoolExecutor(len(hints)) as pool:
                report.lanes = list(
                    pool.map(
                        _continue,
                        [c.id for c in forked.children],
                        [c.timings_ms.get("ready", 0.0) for c in forked.children],
                        hints,
                    )
                )
    finally:
        for child_id in started:
            with contextlib.suppress(ForkdError):
                ch.kill(child_id, store)
        with contextlib.suppress(ForkdError):
            store.remove(report.branch_tag)
    if server is not None:
        report.requests = server.completions()
    report.problems = check(report)
    report.seconds = time.perf_counter() - t_start
    return report


def _is_steered(request: RecordedRequest) -> bool:
    body = request.body if isinstance(request.body, dict) else {}
    return any(
        "Steering hint:" in str(m.get("content"))
        for m in body.get("messages", [])
        if isinstance(m, dict)
    )


def check(report: LanggraphDemoReport) -> list[str]:
    """What the demo shows, as problems found (empty: all true): every grandchild's history
    starts with the source's history at the branch, the continuations differ, and (with the
    stand-in) the model saw the pre-branch calls once and each grandchild's own calls."""
    problems = []
    pre = report.source_messages
    if not pre:
        problems.append("the source recorded no messages before the branch")
    for lane in report.lanes:
        if lane.messages[: len(pre)] != pre:
            problems.append(f"{lane.hint}: its history does not start with the source's")
        if not lane.answer:
            problems.append(f"{lane.hint}: no answer")
    answers = [lane.answer for lane in report.lanes]
    if len(set(answers)) != len(answers):
        problems.append("two grandchildren gave the same plan")
    if report.requests:
        before = [r for r in report.requests if not _is_steered(r)]
        if len(before) != PRE_BRANCH_STEPS:
            problems.append(
                f"the model got {len(before)} un-steered calls, expected the "
                f"source's {PRE_BRANCH_STEPS} only (a pre-branch call was repeated)"
            )
        after = len(report.requests) - len(before)
        expected = sum(lane.model_calls for lane in report.lanes)
        if after != expected:
            problems.append(
                f"the model got {after} steered calls, the grandchildren counted {expected}"
            )
    return problems


def side_by_side(report: LanggraphDemoReport, width: int = 34) -> list[str]:
    """The day-one plans in columns, with each lane's timings under its hint."""
    cols = []
    for lane in report.lanes:
        head = [
            f"hint: {lane.hint}",
            f"ready {lane.ready_ms:.0f} ms, done {lane.seconds:.1f} s",
            f"{lane.model_calls} model call(s)",
            "-" * width,
        ]
        body = [
            w
            for line in lane.answer.splitlines()
            for w in (textwrap.wrap(line, width, subsequent_indent="  ") or [""])
        ]
        cols.append(head + body)
    rows = max(map(len, cols), default=0)
    return [
        " | ".join(c[i].ljust(width) if i < len(c) else " " * width for c in cols).rstrip()
        for i in range(rows)
    ]


def summary(report: LanggraphDemoReport) -> list[str]:
    lines = [
        f"source {report.source_id}: ready {report.source_ready_ms:.0f} ms, "
        f"{PRE_BRANCH_STEPS} ReAct steps before the branch in {report.source_seconds:.1f} s",
        f"branch pause {report.branch_pause_ms:.1f} ms (branch {report.branch_ms:.0f} ms); "
        f"{len(report.lanes)} grandchildren ready in {report.fork_ms:.0f} ms",
    ]
    if report.requests:
        steered = sum(1 for r in report.requests if _is_steered(r))
        lines.append(
            f"model calls: {len(report.requests) - steered} before the branch "
            f"(made once, by the source), {steered} after it"
        )
    return lines


def run_standin(store: Store, tag: str = DEFAULT_TAG, *, say: Say) -> LanggraphDemoReport:
    """The offline demo: run() against the stand-in model."""
    with (
        tempfile.TemporaryDirectory(prefix="forkd-langgraph-") as tmp,
        standin_endpoint(Path(tmp)) as (endpoint, server),
    ):
        say(f"model: forkd's stand-in at {endpoint.base_url} (deterministic, no real model)")
        return run(store, endpoint, tag, say=say, server=server)
