"""The bundled code-interpreter recipe in a real VM: run_code returns matplotlib figures as
PNG and pandas DataFrames as HTML and text (E2B's result shape), stdout, the last value,
and errors with their traceback; the warm modules are there in every fork."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.store.store import Store

# building the recipe (debootstrap with pandas and matplotlib, boot, warm-up) takes long
# under TCG on a loaded host
pytestmark = [pytest.mark.vm, pytest.mark.timeout(3600)]

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "code-interpreter.toml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def interpreter(store: Store, tiny: str) -> str:
    from forkd.engine import recipe
    from forkd.engine.build import build

    return build(store, recipe.load(RECIPE), "code-interpreter:test").ref


@pytest.fixture
def cell(store: Store, interpreter: str, cleanup_children: None) -> Iterator[str]:
    from forkd.engine import children as ch

    kid = ch.fork(store, interpreter, 1).children[0]
    yield kid.id
    ch.kill(kid.id)


def test_figures_dataframes_values_errors(cell: str) -> None:
    from forkd.engine import children as ch

    warm = ch.run_code(cell, "sorted(k for k in ('np', 'pd', 'plt') if k in globals())")
    assert warm["results"][0]["text"] == "['np', 'pd', 'plt']"  # warmed, not imported now
    fig = ch.run_code(cell, "plt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nprint('drawn')")
    assert fig["error"] is None and fig["stdout"] == "drawn\n"
    pngs = [r for r in fig["results"] if "png" in r]
    assert len(pngs) == 1 and base64.b64decode(pngs[0]["png"]).startswith(PNG_MAGIC)
    assert "Figure" in pngs[0]["text"] and not pngs[0]["is_main_result"]
    df = ch.run_code(cell, "pd.DataFrame({'a': [1, 2], 'b': [3.5, 4.5]})")
    (main,) = df["results"]
    assert main["is_main_result"] and "<table" in main["html"] and "3.5" in main["text"]
    assert ch.run_code(cell, "plt.get_fignums()")["results"][0]["text"] == "[]"  # closed
    err = ch.run_code(cell, "pd.DataFrame({'a': [1]})['missing']")
    assert err["error"]["type"] == "KeyError" and "Traceback" in err["error"]["traceback"]
    assert ch.run_code(cell, "int(np.arange(4).sum())")["value"] == 6
