"""Files moirai writes and reads back: never through a link another user could plant (moirai/files.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

import moirai.cluster.calibration.cache as cache_module
from moirai.cluster.calibration import HostLink, TransferCost, local_calibration, read_calibration, write_calibration
from moirai.cluster.calibration.cache import cache_host_links, cached_links, calibration_cache_path
from moirai.cluster.cost import _ProfileCache
from moirai.errors import CacheError, ClusterError, PlanError
from moirai.files import own_lock_file, read_own_text, write_atomically
from moirai.user_files import parsing

COST = TransferCost(1e-5, 1e9, 1e-6, 1e-12, 1e-6, 1e-12)


def test_a_write_replaces_a_link_at_its_name_and_leaves_what_the_link_pointed_to(tmp_path: Path) -> None:
    """Fault injected: another user's link at the name moirai writes (a shared cache directory) pointing at a file
    of the victim's: before, moirai wrote through it (its temporary name was predictable too)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's own file")
    planted = tmp_path / "calibration.json"
    planted.symlink_to(victim)
    guessed = tmp_path / f"calibration.{os.getpid()}.tmp"  # the temporary name moirai used to write first
    guessed.symlink_to(victim)
    write_calibration(planted, {"cpu->cpu": COST}, private=True)
    assert victim.read_text() == "the victim's own file"
    assert not planted.is_symlink() and read_calibration(planted) == {"cpu->cpu": COST}
    assert stat.S_IMODE(planted.stat().st_mode) == 0o600  # the cache's mode
    guessed.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json", "victim.txt"]  # no temporary left


def test_a_write_that_fails_leaves_neither_a_half_file_nor_a_temporary(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text("old")

    class Unwritable:
        def __str__(self) -> str:
            raise RuntimeError("no text")

    with pytest.raises(TypeError):
        write_atomically(target, Unwritable())  # type: ignore[arg-type]
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_write_that_cannot_be_made_names_the_target_not_its_temporary_file(tmp_path: Path) -> None:
    """Fault injected: a missing folder and a folder at the name, where the error named ``.plan.json.1f2e....tmp``."""
    for target, error in ((tmp_path / "nowhere" / "plan.json", FileNotFoundError), (tmp_path, IsADirectoryError)):
        with pytest.raises(error) as failure:
            write_atomically(target, "{}")
        assert failure.value.filename == str(target) and ".tmp" not in str(failure.value)
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.*.tmp"))  # none left beside the folder either


def test_moirais_own_caches_are_not_read_through_a_link(tmp_path: Path) -> None:
    """A link at the cache's name is not moirai's file: its content is never taken for measured numbers."""
    elsewhere = tmp_path / "elsewhere.json"
    write_calibration(elsewhere, {"cpu->cpu": COST})
    planted = tmp_path / "cache.json"
    planted.symlink_to(elsewhere)
    with pytest.raises(OSError):
        read_own_text(planted)
    with pytest.raises(ClusterError, match=r"cache\.json' is a symbolic link, which moirai does not follow.*elsewhere"):
        read_calibration(planted)  # said so, and what to give instead: before, "Too many levels of symbolic links"
    assert cached_links(planted) == {}  # the cache measures again, and its write replaces the link
    assert os.path.islink(planted)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100_000 + "]" * 100_000, "nests arrays or objects too deeply"),  # was a RecursionError
        ('{"a": {"b": ' * 50_000 + "1" + "}" * 100_000, "nests arrays or objects too deeply"),
        ("1" * 5000, "an integer of more than 4300 digits"),  # was int()'s ValueError, pointing at sys
        ('{"a": 1,', r"is not valid JSON \(.*line 1 column 9.*\); was it cut short"),
    ],
)
def test_json_a_user_hands_moirai_that_python_cannot_read_is_the_readers_error_naming_the_file(text, words) -> None:
    with (
        pytest.raises(PlanError, match=rf"^the file 'x.json' .*{words}"),
        parsing("JSON", "the file 'x.json'", PlanError),
    ):
        json.loads(text)
    with parsing("JSON", "the file 'x.json'", PlanError):
        assert json.loads('{"a": [1, 2.5, null, "x"]}') == {"a": [1, 2.5, None, "x"]}


_ANOTHER_USER = 65534  # nobody


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_cache_folders_moirai_makes_are_private_and_so_are_its_cache_files(tmp_path: Path) -> None:
    """Before: folders 0755 and files 0644 (as the umask let them), so every local user could read the caches."""
    root = tmp_path / "new" / "cache"
    cached = calibration_cache_path(root)
    cache_host_links({HostLink("a", "b", "cpu->cpu"): COST}, root)  # the cache written as moirai writes it
    profiles = _ProfileCache(root, "cpu|a device")
    profiles.times_s["group"] = 1e-3
    profiles.save()
    assert [_mode(p) for p in (root, cached.parent, profiles.path.parent)] == [0o700] * 3
    assert _mode(cached) == _mode(profiles.path) == 0o600


def _another_users(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    os.chown(path, _ANOTHER_USER, _ANOTHER_USER)
    return path


_AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user (chown) needs root")


@pytest.mark.parametrize(
    ("squat", "words"),
    [
        pytest.param(lambda root: _another_users(root), "belongs to user 65534, not to this user", marks=_AS_ROOT),
        pytest.param(lambda root: _another_users(root / "calibration"), "belongs to user 65534", marks=_AS_ROOT),
        (lambda root: (root / "calibration").symlink_to(root.parent / "victims"), "is a symbolic link"),
    ],
    ids=["another-users-root", "another-users-subfolder", "a-link"],
)
def test_a_cache_folder_another_user_could_have_filled_is_refused_naming_it(tmp_path: Path, squat, words) -> None:
    """Fault injected: MOIRAI_CACHE_DIR's folder made first by another user (a name in /tmp), or a subfolder of it
    theirs, or a link to a folder of the victim's. Before, moirai read the numbers planted there (3.1 s of
    'measured' latency per message) and wrote through the link."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    (tmp_path / "victims").mkdir(mode=0o700)
    squat(root)
    planted = root / "calibration" / calibration_cache_path(tmp_path / "fresh").name
    if not planted.parent.is_symlink():
        write_calibration(planted, {"cpu->cpu": TransferCost(5.0, 1.0, 0.0, 0.0, 0.0, 0.0)})
    for reader in (lambda: local_calibration(["cpu", "cpu"], "auto", root), lambda: calibration_cache_path(root)):
        with pytest.raises(CacheError, match=rf"the cache folder {tmp_path}/cache\S* {words}.*MOIRAI_CACHE_DIR"):
            reader()
    assert list((tmp_path / "victims").iterdir()) == []  # nothing written through the link


@_AS_ROOT
def test_a_profile_cache_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    _another_users(tmp_path / "profiles")
    with pytest.raises(CacheError, match=r"profiles belongs to user 65534"):
        _ProfileCache(tmp_path, "cpu|a device")


@pytest.mark.parametrize("mode", [0o775, 0o777], ids=["umask-002", "writable-by-all"])
def test_a_cache_folder_of_this_users_others_can_write_to_is_tightened_not_refused(tmp_path: Path, mode) -> None:
    """An older moirai made its folders 0777 & ~umask: 0775 under the umask 002 of Fedora and RHEL. Before, every
    compile of that user then failed with 'has mode 775: other users can write to it'."""
    root = tmp_path / "cache"
    umask = os.umask(0o777 & ~mode)
    try:
        (root / "calibration").mkdir(parents=True)
        (root / "profiles").mkdir()
    finally:
        os.umask(umask)
    assert _mode(root / "calibration") == mode
    cached = calibration_cache_path(root)
    _ProfileCache(root, "cpu|a device")
    assert [_mode(p) for p in (root, cached.parent, root / "profiles")] == [mode & ~0o022] * 3


@pytest.mark.parametrize(
    ("root", "words"),
    [
        (lambda tmp: tmp / "a-file", r"a-file is not a folder \(Not a directory\)"),
        (lambda tmp: tmp / "a-file" / "below" / "cache", r"a-file/below cannot be made \(Not a directory\)"),
    ],
    ids=["a-file", "below-a-file"],
)
def test_a_cache_folder_that_is_a_file_or_cannot_be_made_is_a_cache_error_naming_it(tmp_path: Path, root, words):
    """Before: MOIRAI_CACHE_DIR naming a file, or a folder below one, reached compile as a raw NotADirectoryError."""
    (tmp_path / "a-file").write_text("")
    for reader in (lambda: calibration_cache_path(root(tmp_path)), lambda: _ProfileCache(root(tmp_path), "cpu|x")):
        with pytest.raises(CacheError, match=rf"the cache folder {tmp_path}/{words}; set MOIRAI_CACHE_DIR"):
            reader()


def test_a_calibration_lock_held_too_long_is_an_error_naming_the_lock_and_its_holder(tmp_path: Path, monkeypatch):
    """Fault injected: a process holds the calibration cache's lock and never lets go. Before, compile waited for it
    forever (no timeout on the flock)."""
    import fcntl
    import threading

    monkeypatch.setattr(cache_module, "_LOCK_WAIT_S", 0.5, raising=False)
    monkeypatch.setattr(cache_module, "measure_link_kinds", lambda pair: pytest.fail("measured under a held lock"))
    lock_path = calibration_cache_path(tmp_path).with_suffix(".lock")
    lock_path.parent.mkdir(exist_ok=True)
    errors: list[BaseException] = []

    def calibrate() -> None:
        try:
            local_calibration(["cpu", "cpu"], "auto", tmp_path)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            errors.append(error)

    with own_lock_file(lock_path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=calibrate, daemon=True)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "compile still waits for the calibration lock"
    assert len(errors) == 1 and isinstance(errors[0], CacheError), errors
    assert f"lock {lock_path} is held by process {os.getpid()} (for 0.5 s" in str(errors[0])


def test_a_file_the_user_names_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    """Before: every write made a new file of mode 0644, so a plan the user had made private (chmod 600) became
    readable by all when saved again."""
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    plan.chmod(0o600)
    write_atomically(plan, '{"saved": "again"}')
    assert _mode(plan) == 0o600
    fresh = tmp_path / "fresh.json"
    write_atomically(fresh, "{}")
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(fresh) == 0o644 & ~umask  # as open() would have made it
    # A calibration file the user names (write_calibration's default) follows the same rule, not the cache's 0600.
    named = tmp_path / "calibration.json"
    write_calibration(named, {"cpu->cpu": COST})
    assert _mode(named) == 0o644 & ~umask


@pytest.mark.parametrize(
    ("value", "options", "words"),
    [
        (10**400, {}, "is an integer of about 401 digits, too large for a float"),
        (-(10**400), {"negative": True}, "is an integer of about 401 digits"),
        (float("nan"), {"negative": True, "infinite": True}, "is NaN"),
        (float("inf"), {}, "is infinite"),
        (-1.0, {}, "is negative (-1)"),
        (True, {}, "is true, not a number"),
        ("1", {}, "is '1', not a number"),
        (None, {}, "is null, not a number"),
    ],
)
def test_a_number_no_float_of_its_field_holds_is_named_in_words(value, options, words) -> None:
    """moirai.file_numbers: the one rule every reader of a file's or a cache's numbers applies (10**400 was an
    OverflowError wherever float(), math.isfinite or numpy met it)."""
    from moirai.file_numbers import float_fault

    assert words in float_fault(value, **options)


def test_numbers_a_field_allows_are_no_fault_and_ints_are_held_to_their_range() -> None:
    from moirai.file_numbers import INT64_MAX, float_fault, int_fault

    assert [float_fault(v) for v in (0, 1.5, 10**300, 1e308)] == [None] * 4
    assert float_fault(float("inf"), infinite=True) is None and float_fault(-2, negative=True) is None
    assert int_fault(INT64_MAX) is None and int_fault(2**63) == f"is {2**63}, outside {-(2**63)}..{INT64_MAX}"
    assert int_fault(3, 0, 1) == "is 3, outside 0..1" and int_fault(1.0) == "is float '1.0', not a whole number"
    assert "about 401 digits" in int_fault(10**400)


def _not_regular_files(tmp_path: Path) -> list[str]:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    return [str(fifo), "/dev/zero"]


@pytest.mark.timeout(60)
def test_a_user_file_that_is_no_regular_file_is_the_readers_error_before_a_byte_is_read(tmp_path: Path) -> None:
    """Fault injected: a FIFO hung the read (its open waits for a writer) and /dev/zero was read until memory ran
    out, for plan, problem and cluster files alike (moirai.user_files.read_text)."""
    import moirai
    from moirai.plan_records import read_plan_file
    from moirai.planning.problem import Problem

    readers = [(read_plan_file, PlanError), (Problem.from_json, moirai.ProblemError)]
    readers.append((moirai.Cluster.from_file, ClusterError))
    for path in _not_regular_files(tmp_path):
        for read, error in readers:
            with pytest.raises(error, match=rf"{path}.*not a regular file.*give the path of a file"):
                read(path)


@pytest.mark.timeout(60)
def test_a_cache_that_is_no_regular_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "cache.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        read_own_text(fifo)
