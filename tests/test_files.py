"""Files moirai writes and reads back: never through a link another user could plant (moirai/files.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from moirai.cluster.calibration import TransferCost, read_calibration, write_calibration
from moirai.cluster.calibration.cache import cached_links
from moirai.errors import ClusterError, PlanError
from moirai.files import read_own_text, write_atomically
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
    write_calibration(planted, {"cpu->cpu": COST})
    assert victim.read_text() == "the victim's own file"
    assert not planted.is_symlink() and read_calibration(planted) == {"cpu->cpu": COST}
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(planted.stat().st_mode) == 0o644 & ~umask  # as open() would have made it
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
