"""One stack as users run it: vLLM's default torch.compile mode, not the tests' ``--enforce-eager``.

The other e2e tests run every engine eagerly (:data:`tests.e2e.harness.EAGER`) to start in half
the time. The connector's hooks (KV saves on P, loads on D) run inside the model's forward,
which torch.compile traces; this stack checks they still move the whole prompt there. The
reference is the prefill node answering the same request itself: a plain vLLM in the same
compile mode, dtype and thread count as the decode node (one OpenMP thread each).
"""

from __future__ import annotations

import uuid

import pytest

from kvrelay.deploy import launch
from kvrelay.deploy.launch import Role
from tests.e2e.harness import BLOCK, CASES, openai_client, retire, run_case, start_stack

pytestmark = pytest.mark.slow
PORT0 = 22700
COMPILED = [CASES[4], CASES[9], CASES[6]]     # c600 (completion), h500 (chat, streamed), c1100 (5 chunks)


@pytest.fixture(scope="module")
def compiled_stack(tiny_model, tmp_path_factory):
    handle = start_stack(tiny_model, tmp_path_factory.mktemp("stack-compiled"), PORT0, engine__extra_args=[])
    yield handle
    retire(handle.stack)


@pytest.mark.parametrize("case", COMPILED, ids=lambda c: c.name)
def test_compiled_engines_move_the_whole_prompt_and_answer_exactly(compiled_stack, case):
    stack = compiled_stack.stack
    assert "--enforce-eager" not in launch.server_command(compiled_stack.cfg, stack.specs[0])
    p_url = stack.url(next(s for s in stack.specs if s.role is Role.PREFILL))
    want, _ = run_case(openai_client(p_url), case)          # P alone: no transfer params, no push
    rid = f"compiled-{case.name}-{uuid.uuid4().hex[:6]}"
    got, _ = run_case(openai_client(compiled_stack.router_url), case, rid)
    assert got == want, f"{case.name}: the compiled stack's answer differs from its prefill node's own"
    done = next(e for e in compiled_stack.wait_events(rid, {"load_done"}) if e["event"] == "load_done")
    assert done["recomputed_tokens"] == 0 and not done["failed"], done
    assert done["loaded_tokens"] >= done["prompt_tokens"] - BLOCK, done
