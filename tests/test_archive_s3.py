"""The archive's behaviour tests again, on a real S3-compatible server: moto's standalone server
on 127.0.0.1 and a free port (loopback only), reached through obstore as `s3://bucket/...`."""

import json
import socket
import uuid

import boto3
import pytest
from moto.server import ThreadedMotoServer

from equibuffer._archive import Archive

from .test_archive import (  # noqa: F401  (collected again here with the S3 `location`)
    crash_writer_many_times,
    Location,
    test_committed_steps_never_change_while_a_reader_reads,
    test_first_write_after_the_ring_wrapped_is_not_silent,
    test_full_ring_is_written_and_one_more_is_lost,
    test_iterate_in_chunks,
    test_load_into_a_trajectory_buffer_for_offline_training,
    test_one_writer_at_a_time_any_number_of_readers,
    test_out_of_range_reads_are_clear_errors,
    test_read_only_opening,
    test_reopen_continues_and_restore_resumes,
    test_sampling_is_uniform_over_valid_windows,
    test_schema_mismatch_names_the_leaves,
    test_the_lock_is_a_conditional_put,
    test_write_appends_exactly_the_new_steps,
    test_write_async_checks_lost_steps_when_called,
)
from .test_archive_set import readers_while_writers_are_killed


BUCKET = "equibuffer-test"


@pytest.fixture(scope="module")
def s3_options():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys).create_bucket(
        Bucket=BUCKET
    )
    yield {
        "endpoint": endpoint,
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "region": "us-east-1",
        "client_options": {"allow_http": True},
    }
    server.stop()


@pytest.fixture
def location(s3_options) -> Location:
    return Location(f"s3://{BUCKET}/{uuid.uuid4().hex}.zarr", s3_options, rounds=3)


def test_s3_lock_is_a_conditional_put(location):
    """Two writers racing on S3: the lock is taken with a create-only PUT, so exactly one
    wins (the second one here is in the same process, so its lock is not stale)."""
    from equibuffer._archive import ArchiveLockedError

    from .test_archive import new_buffer

    first = location.open(new_buffer())
    with pytest.raises(ArchiveLockedError):
        location.open(new_buffer())
    first.close()
    location.open(new_buffer()).close()


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
def test_s3_writer_killed_at_random_moments(s3_options):
    store = f"s3://{BUCKET}/crash-{uuid.uuid4().hex}.zarr"
    crash_writer_many_times(store, json.dumps(s3_options), 2, 1)


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
def test_s3_four_readers_sample_one_archive_while_its_writer_is_killed(s3_options):
    """The local test of many processes on the server: one writer appends to one archive on
    S3 and 4 reader processes read and sample it concurrently; the writer is killed mid-write
    while they read. Every value they get is checked, their lengths never go back, and
    nothing the writer reported committed is lost."""
    store = f"s3://{BUCKET}/readers-{uuid.uuid4().hex}.zarr"
    readers_while_writers_are_killed([store], s3_options)


def test_s3_options_in_s3fs_spelling_reach_the_same_store(s3_options):
    """The fixture's options are obstore's spelling; s3fs's spelling of the same settings
    opens the same archive (and a setting obstore has no spelling for is a clear error)."""
    from .test_archive import add, assert_tree_equal, expected, new_buffer

    url = f"s3://{BUCKET}/{uuid.uuid4().hex}.zarr"
    s3fs_spelling = {
        "endpoint_url": s3_options["endpoint"],
        "key": s3_options["access_key_id"],
        "secret": s3_options["secret_access_key"],
        "client_kwargs": {"region_name": s3_options["region"]},
    }
    with Archive(url, new_buffer(), storage_options=s3_options, progress=False) as archive:
        archive.write(add(new_buffer(), 5))
    assert_tree_equal(Archive(url, mode="r", storage_options=s3fs_spelling).read(), expected(0, 5))
    with pytest.raises(ValueError, match="passed to obstore, which does not take one of them"):
        Archive(url, mode="r", storage_options={**s3_options, "use_ssl": False})
