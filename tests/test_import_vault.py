"""`from_vault`: a Flashbax Vault, written by Flashbax itself, imported into an archive bit for
bit (rows, tree, dtypes, the steps `[0, vault_index)`), with `episode_end` made from its done
flags; the errors raised before any write; an import killed part way carried on."""

import contextlib
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import flashbax as fbx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flashbax.vault import Vault

import equibuffer as eb
from equibuffer._offline._source import SourceError
from equibuffer._offline._vault import VaultSource


ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = 3


def nested_example() -> dict:
    return {
        "obs": {"state": jnp.zeros((3, 4), jnp.float32), "image": jnp.zeros((4, 4, 3), jnp.uint8)},
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        "done": jnp.bool_(False),
    }


FLAGS = ("terminals", "truncations", "terminated", "truncated", "done", "dones")


def random_steps(rng: np.random.Generator, example: dict, rows: int, k: int) -> dict:
    """Random steps of `example`'s leaves, `(rows, k, *leaf)`; flags (boolean leaves and
    those named as flags) true one step in five."""

    def one(path, x):
        shape, dtype = (rows, k, *x.shape), np.dtype(x.dtype)
        if dtype == np.bool_ or path[-1].key in FLAGS:
            return jnp.asarray((rng.random(shape) < 0.2).astype(dtype))
        if dtype.kind in "iu":
            return jnp.asarray(rng.integers(0, 200, shape).astype(dtype))
        return jnp.asarray(rng.standard_normal(shape).astype(dtype))

    return jax.tree_util.tree_map_with_path(one, example)


def write_vault(
    rel_dir: pathlib.Path,
    name: str,
    uid: str,
    example: dict,
    writes: list[int],
    *,
    rows: int = ROWS,
    seed: int = 0,
    flat: bool = False,
) -> int:
    """A vault written by Flashbax: `writes[i]` steps added to a Flashbax buffer, then
    `vault.write`, for each i (the buffer wraps in between). Returns the vault index."""
    length = max(writes) + 5
    if flat:
        buffer = fbx.make_flat_buffer(
            max_length=rows * length, min_length=2 * rows, sample_batch_size=1, add_batch_size=rows
        )
    else:
        buffer = fbx.make_trajectory_buffer(
            add_batch_size=rows,
            max_length_time_axis=length,
            min_length_time_axis=1,
            sample_batch_size=1,
            sample_sequence_length=1,
            period=1,
        )
    state = buffer.init(example)
    rng = np.random.default_rng(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # Flashbax prints where the vault is
        vault = Vault(
            vault_name=name,
            experience_structure=state.experience,
            rel_dir=str(rel_dir),
            vault_uid=uid,
        )
        for k in writes:
            if flat:  # one step of every row an add
                for _ in range(k):
                    step = random_steps(rng, example, rows, 1)
                    state = buffer.add(state, jax.tree.map(lambda x: x[:, 0], step))
            else:
                state = buffer.add(state, random_steps(rng, example, rows, k))
            assert vault.write(state) == k
    return vault.vault_index


def vault_experience(rel_dir: pathlib.Path, name: str, uid: str) -> dict:
    """What Flashbax itself reads back from the vault: every written step."""
    with contextlib.redirect_stdout(io.StringIO()):
        return jax.tree.map(
            np.asarray,
            Vault(vault_name=name, rel_dir=str(rel_dir), vault_uid=uid).read().experience,
        )


def assert_bit_equal(got, want, where: str = "") -> None:
    assert type(got) is type(want) is dict, where
    assert set(got) == set(want), (where, set(got), set(want))
    for k in want:
        if isinstance(want[k], dict):
            assert_bit_equal(got[k], want[k], f"{where}[{k!r}]")
        else:
            a, b = np.asarray(got[k]), np.asarray(want[k])
            assert a.dtype == b.dtype and a.shape == b.shape, (where, k, a.dtype, b.dtype)
            assert a.tobytes() == b.tobytes(), (where, k)


def without_end(steps: dict) -> dict:
    return {k: v for k, v in steps.items() if k != "episode_end"}


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    """One vault of the nested, mixed-dtype experience: 5 writes of 7 steps (index 35)."""
    rel_dir = tmp_path_factory.mktemp("vaults")
    index = write_vault(rel_dir, "nested", "seed0", nested_example(), [7] * 5)
    return rel_dir, index, vault_experience(rel_dir, "nested", "seed0")


def test_archive_equals_the_vault_bit_for_bit(nested, tmp_path):
    rel_dir, index, want = nested
    assert index == 35
    archive = eb.from_vault(rel_dir / "nested" / "seed0", tmp_path / "a.zarr", progress=False)
    assert len(archive) == index and archive.rows == ROWS and archive.read_only
    steps = archive.read()
    assert_bit_equal(without_end(steps), want)
    assert steps["episode_end"].dtype == np.bool_ and steps["episode_end"].shape == (ROWS, index)
    assert np.array_equal(steps["episode_end"], want["done"])  # on the episodes' last steps
    # Without `like`, the leaves by name: those of the vault, and `episode_end`.
    names = set(eb.Archive(tmp_path / "a.zarr", mode="r", progress=False).read())
    assert names == {"action", "done", "episode_end", "obs.image", "obs.state", "reward"}


def test_blocks_read_only_their_slice(nested):
    """The source reads `[start, stop)` of every leaf, in any order and size."""
    rel_dir, index, want = nested
    source = VaultSource(rel_dir / "nested")
    assert (source.steps, source.rows) == (index, ROWS)
    for a, b in [(0, 1), (3, 17), (34, 35), (10, 10), (0, 35)]:
        got = source.read(a, b)
        assert_bit_equal(without_end(got), jax.tree.map(lambda x, a=a, b=b: x[:, a:b], want))
        assert got["episode_end"].shape == (ROWS, b - a)
    with pytest.raises(IndexError, match=r"\[30, 36\).*\[0, 35\)"):
        source.read(30, 36)  # past the vault index: the unwritten tail is never read
    source.close()


def test_many_small_blocks(tmp_path):
    """With a small `memory`, the import is many blocks; the result is the same."""
    example = {"image": jnp.zeros((64, 64, 3), jnp.uint8), "done": jnp.bool_(False)}
    index = write_vault(tmp_path, "frames", "u", example, [30, 30, 20], rows=2)
    source = VaultSource(tmp_path / "frames")
    assert int((1 << 20) * 0.25) // source.step_bytes() < index // 4  # at least 4 blocks
    archive = eb.from_vault(
        tmp_path / "frames", tmp_path / "a.zarr", memory=1 << 20, progress=False
    )
    steps, want = archive.read(), vault_experience(tmp_path, "frames", "u")
    assert_bit_equal(without_end(steps), want)
    assert np.array_equal(steps["episode_end"], want["done"])


def test_metadata_and_identity(nested, tmp_path):
    rel_dir, index, _ = nested
    archive = eb.from_vault(rel_dir / "nested", tmp_path / "a.zarr", progress=False)
    meta = archive.metadata
    assert meta["format"] == "flashbax-vault"
    assert (meta["vault_name"], meta["vault_uid"]) == ("nested", "seed0")
    assert meta["episode_end"] == ["done"]
    on_disk = json.loads((rel_dir / "nested" / "seed0" / "metadata.json").read_text())
    assert meta["vault"] == on_disk
    assert meta["vault"]["structure_dtype"]["obs"] == {"image": "uint8", "state": "float32"}
    assert meta["source"] == {
        "format": "flashbax-vault",
        "location": str((rel_dir / "nested" / "seed0").absolute()),
        "steps": index,
        "rows": ROWS,
        "episode_end": ["done"],
    }


def test_a_flat_buffer_vault(tmp_path):
    """A vault of `fbx.make_flat_buffer`'s state (a trajectory buffer underneath)."""
    example = {"obs": jnp.zeros(2, jnp.float32), "terminated": jnp.bool_(False)}
    index = write_vault(tmp_path, "flat", "u", example, [4, 6, 5], rows=2, flat=True)
    archive = eb.from_vault(tmp_path / "flat", tmp_path / "a.zarr", progress=False)
    want = vault_experience(tmp_path, "flat", "u")
    steps = archive.read()
    assert len(archive) == index == 15 and archive.rows == 2
    assert_bit_equal(without_end(steps), want)
    assert np.array_equal(steps["episode_end"], want["terminated"])


def test_episode_end_choices(tmp_path):
    """ "auto" ORs the flags there are, reduced over an agent axis (OG-MARL's layout); a
    string names one leaf; a function computes it; None adds none; "auto" without flags adds
    none."""
    example = {
        "observations": jnp.zeros((2, 5), jnp.float32),
        "terminals": jnp.zeros(2, jnp.float32),  # per agent, numeric
        "truncations": jnp.zeros(2, jnp.bool_),
        "rewards": jnp.zeros(2, jnp.float32),
    }
    write_vault(tmp_path, "marl", "u", example, [6, 6])
    want = vault_experience(tmp_path, "marl", "u")
    term, trunc = want["terminals"] != 0, want["truncations"]
    assert term.any() and trunc.any() and not np.array_equal(term, trunc)
    vault = tmp_path / "marl"

    auto = eb.from_vault(vault, tmp_path / "auto.zarr", progress=False)
    assert np.array_equal(auto.read()["episode_end"], term.any(-1) | trunc.any(-1))
    assert auto.metadata["episode_end"] == ["terminals", "truncations"]

    named = eb.from_vault(vault, tmp_path / "named.zarr", episode_end="truncations", progress=False)
    assert np.array_equal(named.read()["episode_end"], trunc.any(-1))

    def first_agent_done(steps):
        return steps["terminals"][..., 0] > 0

    computed = eb.from_vault(
        vault, tmp_path / "fn.zarr", episode_end=first_agent_done, progress=False
    )
    assert np.array_equal(computed.read()["episode_end"], term[..., 0])
    assert computed.metadata["episode_end"].endswith("first_agent_done")

    none = eb.from_vault(vault, tmp_path / "none.zarr", episode_end=None, progress=False)
    assert_bit_equal(none.read(), want)

    plain = {"obs": jnp.zeros(2, jnp.float32), "action": jnp.int32(0)}
    write_vault(tmp_path, "plain", "u", plain, [3])
    archive = eb.from_vault(tmp_path / "plain", tmp_path / "plain.zarr", progress=False)
    assert set(archive.read()) == {"obs", "action"}  # no flags: no episode_end
    assert archive.metadata["episode_end"] is None


def test_loader_windows_never_cross_an_episode_end(nested, tmp_path):
    rel_dir, index, want = nested
    archive = eb.from_vault(rel_dir / "nested", tmp_path / "a.zarr", progress=False)
    done = want["done"]
    seen = 0
    with eb.ArchiveLoader(
        archive, jax.random.key(0), 8, sequence_length=4, episode_end="episode_end", epochs=1
    ) as loader:
        for batch in loader:
            ends = np.asarray(batch.experience["episode_end"])
            mask = np.asarray(batch.mask)
            assert not ends[mask][:, :-1].any()
            for row, start, m, state in zip(
                np.asarray(batch.rows),
                np.asarray(batch.starts),
                mask,
                np.asarray(batch.experience["obs"]["state"]),
                strict=True,
            ):
                if m:
                    window = want["obs"]["state"][row, start : start + 4]
                    assert window.tobytes() == state.tobytes()
                    seen += 1
    valid = sum(not done[r, s : s + 3].any() for r in range(ROWS) for s in range(index - 3))
    assert seen == valid > 0  # each valid window once


# ------------------------------------------------------------------------ where a vault is


def test_vault_name_dir_picks_its_one_uid_or_vault_uid(tmp_path):
    example = {"x": jnp.zeros(2, jnp.float32), "done": jnp.bool_(False)}
    write_vault(tmp_path, "two", "a", example, [3], seed=1)
    write_vault(tmp_path, "two", "b", example, [5], seed=2)
    with pytest.raises(SourceError, match=r"several vaults \(a, b\).*vault_uid="):
        eb.from_vault(tmp_path / "two", tmp_path / "x.zarr", progress=False)
    assert not (tmp_path / "x.zarr").exists()
    archive = eb.from_vault(tmp_path / "two", tmp_path / "b.zarr", vault_uid="b", progress=False)
    assert len(archive) == 5 and archive.metadata["vault_uid"] == "b"
    with pytest.raises(SourceError, match=r"vault_uid='c'.*the vaults there: a, b"):
        eb.from_vault(tmp_path / "two", tmp_path / "c.zarr", vault_uid="c", progress=False)
    write_vault(tmp_path, "one", "only", example, [4])
    archive = eb.from_vault(tmp_path / "one", tmp_path / "one.zarr", progress=False)
    assert len(archive) == 4 and archive.metadata["vault_uid"] == "only"


# ----------------------------------------------------------------------------------- errors


def test_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no directory .*nowhere"):
        eb.from_vault(tmp_path / "nowhere", tmp_path / "a.zarr")
    assert not (tmp_path / "a.zarr").exists()


def test_not_a_vault(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(SourceError, match=r"empty is not a Flashbax vault.*metadata\.json"):
        eb.from_vault(tmp_path / "empty", tmp_path / "a.zarr")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metadata.json").write_text('{"name": "not a vault"}')
    with pytest.raises(SourceError, match="not a Flashbax vault's metadata"):
        eb.from_vault(tmp_path / "other", tmp_path / "a.zarr")
    assert not (tmp_path / "a.zarr").exists()


def test_a_named_episode_end_that_is_not_there(nested, tmp_path):
    rel_dir, _, _ = nested
    with pytest.raises(
        SourceError, match=r"episode_end='terminals'.*top-level leaves: action, done, reward"
    ):
        eb.from_vault(rel_dir / "nested", tmp_path / "a.zarr", episode_end="terminals")
    with pytest.raises(SourceError, match=r"episode_end='obs'.*no boolean or number"):
        eb.from_vault(rel_dir / "nested", tmp_path / "a.zarr", episode_end="obs")
    assert not (tmp_path / "a.zarr").exists()


def test_an_episode_end_leaf_already_there(tmp_path):
    example = {"x": jnp.zeros(2, jnp.float32), "episode_end": jnp.bool_(False)}
    write_vault(tmp_path, "ends", "u", example, [3])
    with pytest.raises(SourceError, match="has an `episode_end` leaf already.*episode_end=None"):
        eb.from_vault(tmp_path / "ends", tmp_path / "a.zarr")
    assert not (tmp_path / "a.zarr").exists()
    archive = eb.from_vault(
        tmp_path / "ends", tmp_path / "a.zarr", episode_end=None, progress=False
    )
    assert_bit_equal(archive.read(), vault_experience(tmp_path, "ends", "u"))


def test_an_experience_that_is_not_a_dict(tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        buffer = fbx.make_trajectory_buffer(
            add_batch_size=2,
            max_length_time_axis=8,
            min_length_time_axis=1,
            sample_batch_size=1,
            sample_sequence_length=1,
            period=1,
        )
        state = buffer.init(jnp.zeros(3))
        vault = Vault(
            vault_name="bare",
            experience_structure=state.experience,
            rel_dir=str(tmp_path),
            vault_uid="u",
        )
        vault.write(buffer.add(state, jnp.ones((2, 4, 3))))
    with pytest.raises(SourceError, match="not a dict of leaves"):
        eb.from_vault(tmp_path / "bare", tmp_path / "a.zarr")


def test_a_bad_episode_end_function(nested, tmp_path):
    rel_dir, _, _ = nested
    with pytest.raises(SourceError, match=r"returned float32\[3, 1\].*expected bool\[3, 1\]"):
        eb.from_vault(rel_dir / "nested", tmp_path / "a.zarr", episode_end=lambda s: s["reward"])
    assert not (tmp_path / "a.zarr").exists()


def test_like_a_buffer_that_differs(nested, tmp_path):
    rel_dir, _, want = nested
    example = jax.tree.map(lambda x: jnp.zeros(x.shape[2:], x.dtype), want)
    same = eb.TrajectoryBuffer(
        {**example, "episode_end": jnp.bool_(False)},
        add_batch_size=ROWS,
        max_length_time_axis=8,
        sequence_length=2,
    )
    other = eb.TrajectoryBuffer(
        {**example, "action": jnp.zeros((), jnp.float32), "episode_end": jnp.bool_(False)},
        add_batch_size=ROWS,
        max_length_time_axis=8,
        sequence_length=2,
    )
    with pytest.raises(SourceError, match=r"do not match `like`.*action"):
        eb.from_vault(rel_dir / "nested", tmp_path / "a.zarr", like=other)
    assert not (tmp_path / "a.zarr").exists()
    archive = eb.from_vault(rel_dir / "nested", tmp_path / "a.zarr", like=same, progress=False)
    assert len(archive) == 35


# --------------------------------------------------------------------------------- resuming


def test_run_again_adds_nothing_and_a_grown_vault_is_another_import(tmp_path):
    example = {"x": jnp.zeros(2, jnp.float32), "done": jnp.bool_(False)}
    write_vault(tmp_path, "grows", "u", example, [4, 4])
    path = tmp_path / "a.zarr"
    first = eb.from_vault(tmp_path / "grows", path, progress=False).read()
    again = eb.from_vault(tmp_path / "grows", path, progress=False)
    assert len(again) == 8
    assert_bit_equal(again.read(), first)
    # The vault written on: its steps are another import's (the archive would mix them).
    with contextlib.redirect_stdout(io.StringIO()):
        vault = Vault(vault_name="grows", rel_dir=str(tmp_path), vault_uid="u")
        buffer = fbx.make_trajectory_buffer(
            add_batch_size=ROWS,
            max_length_time_axis=8,
            min_length_time_axis=1,
            sample_batch_size=1,
            sample_sequence_length=1,
            period=1,
        )
        state = buffer.init(example)
        vault.write(buffer.add(state, random_steps(np.random.default_rng(5), example, ROWS, 3)))
    with pytest.raises(SourceError, match=r"'steps': 8.*not of .*'steps': 11.*new path"):
        eb.from_vault(tmp_path / "grows", path, progress=False)


_KILLED = """
import sys, time
from equibuffer._offline import _vault
read = _vault.VaultSource.read
def slow(self, start, stop):
    time.sleep(0.1)  # many blocks, each taking a while: the kill lands in the middle
    return read(self, start, stop)
_vault.VaultSource.read = slow
_vault.from_vault(sys.argv[1], sys.argv[2], memory=1 << 20, progress=False)
print("finished")
"""


@pytest.mark.slow
def test_an_import_killed_part_way_carries_on(tmp_path):
    """SIGKILL the importing process once it has committed some blocks; the import run again
    carries on from the archive's length, and the archive equals the vault bit for bit."""
    example = {
        "obs": {"image": jnp.zeros((32, 32, 3), jnp.uint8), "state": jnp.zeros(4, jnp.float32)},
        "action": jnp.int32(0),
        "done": jnp.bool_(False),
    }
    index = write_vault(tmp_path, "big", "u", example, [100] * 6)
    want = vault_experience(tmp_path, "big", "u")
    path = tmp_path / "a.zarr"
    source = VaultSource(tmp_path / "big")
    blocks = -(-index // (int((1 << 20) * 0.25) // source.step_bytes()))
    source.close()
    assert blocks >= 15
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", _KILLED, str(tmp_path / "big"), str(path)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert child.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the import never committed a step"
            with contextlib.suppress(FileNotFoundError):
                if len(eb.Archive(path, mode="r", progress=False)) > 0:
                    break
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    done = len(eb.Archive(path, mode="r", progress=False))
    assert 0 < done < index  # killed in the middle
    archive = eb.from_vault(tmp_path / "big", path, memory=1 << 20, progress=False)
    assert len(archive) == archive.source_steps == index  # nothing lost, nothing doubled
    steps = archive.read()
    assert_bit_equal(without_end(steps), want)
    assert np.array_equal(steps["episode_end"], want["done"])
