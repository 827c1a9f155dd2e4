"""`forkd quickstart` end to end with the tiny recipe, twice: the second run reuses everything.
The bundled packs: the declared list, and (with tiny standing in for it) the deeplethe
namespace, a public pack an empty FORKD_HOME pulls and forks, nothing pushed the second time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vm


def _forkd(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        ["forkd", *args],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert proc.returncode == 0, f"forkd {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def test_bundled_recipes_are_one_installed_list():
    from forkd.controller.quickstart import BUNDLED_NAMESPACE, bundled_recipe_paths
    from forkd.engine import recipe

    names = [recipe.load(path).name for path in bundled_recipe_paths()]
    assert BUNDLED_NAMESPACE == "deeplethe"
    assert {"python-numpy", "langgraph-react", "coding-agent", "code-interpreter"} <= set(names)
    assert len(names) == len(set(names))  # one pack per recipe name


def test_embedded_hub_namespace_and_visibility(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The admin steps the bundled packs need, on a real embedded hub (no VM: a synthetic
    pack): the namespace is created once and kept, a pushed pack is private until made
    public, and an anonymous client can then read it."""
    from forkd.controller.quickstart import HUB_USER, embedded_hub
    from forkd.registry import credentials
    from forkd.registry.client import RegistryClient, RegistryError
    from forkd.registry.reference import parse_remote
    from forkd.registry.transfer import push
    from forkd.store.store import Store
    from forkd.synthetic import write_base

    monkeypatch.setenv("FORKD_CREDENTIALS", str(tmp_path / "credentials.json"))
    hub = embedded_hub(tmp_path / "hub", lambda _: None)
    try:
        store = Store(tmp_path / "store")
        image = tmp_path / "mem.img"
        write_base(image, 4 << 20, seed=3)
        store.import_layer("pack:v1", memory=image)
        hub.ensure_namespace("deeplethe")
        hub.ensure_namespace("deeplethe")  # a second run: the namespace exists, no error
        with RegistryClient(hub.hub, credentials.Credential(HUB_USER, hub.password)) as client:
            remote = parse_remote(f"{hub.hub.host}/deeplethe/pack:latest", hub.hub)
            assert push(store, "pack:v1", remote, client).blobs_sent > 0
        assert hub.is_public("deeplethe/pack", "latest") is False
        with RegistryClient(hub.hub, None) as anonymous, pytest.raises(RegistryError):
            anonymous.get_manifest("deeplethe/pack", "latest")
        hub.make_public("deeplethe/pack")
        assert hub.is_public("deeplethe/pack", "latest") is True
        with pytest.raises(Exception, match="could not create namespace"):
            hub.ensure_namespace("Not A Namespace")
    finally:
        state = json.loads((tmp_path / "hub" / "state.json").read_text())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(state["pid"], signal.SIGTERM)


def _pull_and_fork(env: dict[str, str], tmp_path: Path, repository: str, digest: str,
                   n: int) -> None:
    """In a fresh FORKD_HOME (the default hub the main job set): pull ``repository`` (it is
    ``digest``), fork ``n`` children of it, kill them."""
    fresh = {**env, "FORKD_HOME": str(tmp_path / "fresh"), "FORKD_RUN": str(tmp_path / "run2")}
    pulled = json.loads(_forkd(fresh, "pull", repository, "--json"))
    assert pulled["digest"] == digest
    try:
        forked = json.loads(_forkd(fresh, "fork", repository, "-n", str(n), "--json"))
        assert len(forked["children"]) == n and not forked["errors"]
    finally:
        _forkd(fresh, "kill", "--all")


def _quickstart(env: dict[str, str], bundle: Path = REPO / "recipes" / "tiny.toml",
                *more: str, timeout: float = 3000) -> dict[str, object]:
    proc = subprocess.run(
        [
            "forkd",
            "quickstart",
            "--yes",
            "--recipe",
            str(REPO / "recipes" / "tiny.toml"),
            "-n",
            "3",
            "--eval",
            "WARM['recipe'] + str(len(__import__('os').urandom(4)))",
            "--bundle",
            str(bundle),
            "--json",
            *more,
        ],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,  # the first run builds tiny: minutes on a loaded host
    )
    assert proc.returncode == 0, proc.stderr
    report: dict[str, object] = json.loads(proc.stdout)
    return report


@pytest.mark.timeout(3600)  # the first run builds tiny (zstd 19 under TCG on a shared host)
def test_quickstart_twice(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("quickstart forks VMs: needs root")
    env = {
        **os.environ,
        "FORKD_HOME": str(tmp_path / "home"),
        "FORKD_RUN": str(tmp_path / "run"),
        "FORKD_CREDENTIALS": str(tmp_path / "credentials.json"),
    }
    env.pop("FORKD_HUB", None)
    state = tmp_path / "home" / "quickstart" / "hub" / "state.json"
    try:
        first = _quickstart(env)
        assert first["built"] is True and first["push_blobs"] > 0  # type: ignore[operator]
        children = first["children"]
        assert isinstance(children, list) and len(children) == 3
        assert {c["value"] for c in children} == {"tiny4"}
        catalog = str(first["catalog_url"])
        assert catalog.endswith("/forkd/tiny")
        page = httpx.get(catalog, timeout=10)  # browsable signed out: the pack is public
        assert page.status_code == 200 and "forkd pull" in page.text
        [bundled] = first["bundled"]  # type: ignore[misc]
        assert bundled["repository"] == "deeplethe/tiny" and bundled["pushed"] is True
        assert bundled["push_blobs"] > 0
        hub = str(first["hub"])
        anonymous = httpx.get(f"http://{hub}/v2/deeplethe/tiny/manifests/latest", timeout=10)
        assert anonymous.status_code == 200  # public: no credentials needed

        # a fresh FORKD_HOME, the default hub the main job set: pull, then fork
        _pull_and_fork(env, tmp_path, "deeplethe/tiny", str(bundled["digest"]), 3)

        second = _quickstart(env)
        assert second["built"] is False and second["pulled_from_hub"] is False
        assert second["push_blobs"] == 0 and second["pull_blobs"] == 0
        assert second["hub"] == first["hub"]
        [again] = second["bundled"]  # type: ignore[misc]
        assert again["built"] is False and again["pushed"] is False and again["push_blobs"] == 0
        assert again["digest"] == bundled["digest"]
        assert len(second["children"]) == 3  # type: ignore[arg-type]
        assert httpx.get(f"http://{first['hub']}/v2/", timeout=5).status_code in (200, 401)
        assert not list((tmp_path / "run" / "children").glob("tiny-*"))  # children killed
    finally:
        if state.exists():
            pid = json.loads(state.read_text())["pid"]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)


@pytest.mark.timeout(3600)
def test_background_bundles(tmp_path: Path):
    """The main job returns once its forks answered; a bundled pack that still needs a
    build is published by a background job. Pulling it meanwhile says so; the next
    quickstart leaves the job running and returns (a second run takes seconds, however
    long the bundled builds take); `--wait` waits for the job, and then the pack pulls
    and forks."""
    if os.geteuid() != 0:
        pytest.skip("quickstart forks VMs: needs root")
    variant = tmp_path / "tiny-later.toml"  # a recipe no cache holds: it needs a build
    variant.write_text((REPO / "recipes" / "tiny.toml").read_text()
                       .replace('name = "tiny"', 'name = "tiny-later"'))
    home = tmp_path / "home"
    env = {
        **os.environ,
        "FORKD_HOME": str(home),
        "FORKD_RUN": str(tmp_path / "run"),
        "FORKD_CREDENTIALS": str(tmp_path / "credentials.json"),
    }
    env.pop("FORKD_HUB", None)
    state = home / "quickstart" / "hub" / "state.json"
    job = home / "quickstart" / "bundles.json"
    try:
        first = _quickstart(env, variant)
        assert len(first["children"]) == 3  # type: ignore[arg-type]
        assert first["bundled"] == [] and str(first["bundles_log"]).endswith("bundles.log")
        assert json.loads(job.read_text())["state"] == "running"
        early = subprocess.run(["forkd", "pull", "deeplethe/tiny-later", "--tag", "early"],
                               env=env, capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=120)
        assert early.returncode != 0
        assert "still being built by `forkd quickstart` in the background" in early.stderr
        assert "`forkd quickstart --wait`" in early.stderr

        # the job stopped (alive, still running) for the whole second run: a second run
        # that waited for it would never return
        job_pid = int(json.loads(job.read_text())["pid"])
        os.killpg(job_pid, signal.SIGSTOP)
        try:
            second = _quickstart(env, variant, timeout=600)
        finally:
            os.killpg(job_pid, signal.SIGCONT)
        assert len(second["children"]) == 3  # type: ignore[arg-type]
        assert second["bundled"] == [] and second["bundles_log"] == first["bundles_log"]
        assert json.loads(job.read_text())["state"] == "running"  # left to finish

        third = _quickstart(env, variant, "--wait")  # waits for the job: all published
        assert third["bundles_log"] == ""
        [again] = third["bundled"]  # type: ignore[misc]
        assert again["repository"] == "deeplethe/tiny-later" and again["built"] is False
        assert again["pushed"] is False  # the background job pushed it
        done = json.loads(job.read_text())
        assert done["state"] == "done" and done["bundled"][0]["digest"] == again["digest"]

        _pull_and_fork(env, tmp_path, "deeplethe/tiny-later", str(again["digest"]), 1)
    finally:
        if job.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(json.loads(job.read_text())["pid"]), signal.SIGTERM)
        if state.exists():
            pid = json.loads(state.read_text())["pid"]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)


def test_a_running_job_is_left_to_finish_only_for_its_own_packs(tmp_path: Path):
    """A later run leaves a running bundles job alone when it publishes every pack the run
    would (it returns in seconds); a job publishing other packs is not its job: the run
    waits for it (never two builds at once) and publishes its own. A job that died is not
    running."""
    from forkd.controller import bundles_job
    from forkd.controller.quickstart import running_job_for

    assert running_job_for(tmp_path, ["deeplethe/a"]) is None  # no job ever ran here
    state = {"state": "running", "pid": os.getpid(), "repositories": ["deeplethe/a",
                                                                       "deeplethe/b"]}
    (tmp_path / bundles_job.STATE).write_text(json.dumps(state))
    assert running_job_for(tmp_path, ["deeplethe/a"]) == state
    assert running_job_for(tmp_path, ["deeplethe/a", "deeplethe/b"]) == state
    assert running_job_for(tmp_path, ["deeplethe/a", "deeplethe/c"]) is None
    gone = subprocess.Popen(["true"])  # a pid that has ended
    gone.wait()
    (tmp_path / bundles_job.STATE).write_text(json.dumps({**state, "pid": gone.pid}))
    assert running_job_for(tmp_path, ["deeplethe/a"]) is None

