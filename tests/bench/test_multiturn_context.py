"""`kvrelay bench multiturn` serves its conversations within the model's own context, and says
so before starting anything when they would not fit."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvrelay.bench import multiturn


def _args(**over: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    multiturn.add_args(p)
    args = p.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_the_engines_serve_the_models_own_context_up_to_the_cap(tmp_path: Path):
    for own, want in ((4096, 4096), (8192, 8192), (131072, multiturn.CONTEXT_CAP)):
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": own}))
        assert multiturn._context(str(tmp_path)) == want
    assert multiturn._context(str(tmp_path / "absent")) == multiturn.CONTEXT_CAP   # a hub name: the cap


def test_the_default_conversations_fit_the_wide_variant_and_not_the_narrow_one():
    from kvrelay.deploy.tiny_model import POSITIONS

    need = multiturn.longest_history(_args())
    assert POSITIONS["narrow"] < need <= POSITIONS["wide"]


def test_conversations_over_the_context_are_refused_before_anything_starts(tiny_model: Path, tmp_path: Path):
    r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "multiturn", "--model", str(tiny_model),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "over the model's context of 4096" in r.stderr and "--turns" in r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.iterdir())     # nothing started, nothing written
