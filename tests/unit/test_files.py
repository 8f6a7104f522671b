"""Secrets on disk (the Redis password in stack.json and the pidfile, the admin token) are
owner-only whatever the umask and whatever mode an older file had."""

import os
import stat

from specserve.tooling.files import write_private
from specserve.tooling.redis_server import LocalRedis, write_pidfile


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_file_is_owner_only_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        write_private(tmp_path / "secret", "s3cret")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "secret") == 0o600
    assert (tmp_path / "secret").read_text() == "s3cret"


def test_an_existing_world_readable_file_is_replaced_owner_only(tmp_path):
    path = tmp_path / "stack.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_private(path, "new")
    assert _mode(path) == 0o600 and path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["stack.json"]  # no temporary left behind


def test_redis_pidfile_with_the_password_is_owner_only(tmp_path):
    server = LocalRedis(port=2, pid=1, dir=tmp_path, log_path=tmp_path / "log", password="pw")
    write_pidfile(tmp_path / "redis.pid", server)
    assert _mode(tmp_path / "redis.pid") == 0o600
    assert '"password": "pw"' in (tmp_path / "redis.pid").read_text()
