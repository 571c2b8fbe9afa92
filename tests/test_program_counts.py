"""`benchmarks/bench_programs.count_ops`, which counts what makes a GPU wait for the host in a
compiled program (host callbacks, conditionals, the checks among them): pinned here on a
program whose counts are known, so that tests of the library's own programs can rely on it."""

import jax
import jax.numpy as jnp

from benchmarks.bench_programs import callback_targets, compiled_text, count_ops


def _fail(x):
    raise RuntimeError("negative")


def test_count_ops_of_a_known_program():
    def program(x, y):
        # A check as Equinox's `error_if` makes one: a conditional holding a host callback.
        x = jax.lax.cond(
            x.sum() < 0, lambda v: (jax.debug.callback(_fail, v), v)[1], lambda v: v, x
        )
        z = jax.lax.cond(y[0, 0] > 0, lambda v: jnp.sin(v) @ v.T, lambda v: jnp.cos(v) @ v.T, y)
        w = jax.lax.while_loop(lambda c: c[0] < y[1, 1], lambda c: (c[0] + 1, c[1] * 2), (0.0, x))
        return w[1], z

    text = compiled_text(program, jnp.ones(8), jnp.ones((8, 8)))
    counts = count_ops(text)
    assert counts["conditionals"] == 2 and counts["checks"] == 1 and counts["whiles"] == 1
    assert counts["callbacks"] >= 1 and counts["host_transfers"] == 0
    assert callback_targets(text) and all("callback" in t for t in callback_targets(text))


def test_count_ops_of_hlo_text():
    """A check reached through a called computation counts; a plain conditional does not."""
    text = """\
HloModule m

%callback_branch (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %c = s32[] custom-call(%p), custom_call_target="xla_ffi_python_gpu_callback"
}

%checked (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %call = s32[] call(%p), to_apply=%callback_branch
}

%plain (p: s32[]) -> s32[] {
  ROOT %p = s32[] parameter(0)
}

ENTRY %main (x: s32[], b: pred[]) -> (s32[], s32[]) {
  %x = s32[] parameter(0)
  %b = pred[] parameter(1)
  %one = s32[] conditional(%b, %x, %x), branch_computations={%checked, %plain}
  %two = s32[] conditional(%b, %x, %x), true_computation=%plain, false_computation=%plain
  ROOT %t = (s32[], s32[]) tuple(%one, %two)
}
"""
    assert count_ops(text) == {
        "callbacks": 1,
        "conditionals": 2,
        "checks": 1,
        "whiles": 0,
        "host_transfers": 0,
    }
    assert callback_targets(text) == {"xla_ffi_python_gpu_callback"}
