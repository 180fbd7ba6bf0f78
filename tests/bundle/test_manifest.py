"""compile(), run() on emulated ranks, bundles and their manifest: everything short of MPI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tvm_distx as td
from tvm_distx import ShardingRule
from safetensors.numpy import load_file, save_file

from tvm_distx.bundle.manifest import check_weights, read_manifest, sha256_file
from tvm_distx.cli.main import main as cli
from tvm_distx.passes import AnnotateSharding
from tvm_distx.runtime.backends import launch

from reference import mlp_twice  # noqa: E402
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"


def tensor_parallel():
    mod = td.load_module(DATA / "seed_tensor_parallel.py")
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    return AnnotateSharding(rules)(mod)



@pytest.fixture(scope="module")
def exe():
    return td.compile(tensor_parallel(), target="x86")


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(21)
    return [(0.1 * rng.standard_normal((128, 128))).astype("float32") for _ in range(3)]


@pytest.fixture
def bundle(exe, data, tmp_path):
    _, A, B = data
    return exe.export(tmp_path / "bundle", params={"A": A, "B": B})


def test_run_on_emulated_ranks_takes_and_returns_global_arrays(exe, data):
    x, A, B = data
    np.testing.assert_allclose(exe.run(x, params={"A": A, "B": B}, backend="emulate"),
                               mlp_twice(x, A, B), atol=1e-5)
    # positional only, and torch tensors
    torch = pytest.importorskip("torch")
    out = exe.run(*[torch.from_numpy(v) for v in data], backend="emulate")
    np.testing.assert_allclose(out, mlp_twice(x, A, B), atol=1e-5)


def test_the_pipeline_runs_each_stage_program_on_its_ranks():
    mod = td.load_module(DATA / "seed_pipeline.py")
    rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
    exe = td.compile(AnnotateSharding([rule])(mod))
    assert exe.entries["main"] == ["main_rank0", "main_rank1"]
    rng = np.random.default_rng(2)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    np.testing.assert_allclose(exe.run(x, A, B, backend="emulate"), mlp_twice(x, A, B),
                               atol=1e-5)


def test_manifest_lists_meshes_groups_collectives_and_each_ranks_weight_shard(bundle, data):
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["num_ranks"]) == (
        "tvm-distx-bundle", 2, 2)
    assert manifest["meshes"] == [{"name": "mesh[0]", "shape": [2], "devices": [0, 1]}]
    assert manifest["ranks"] == [{"rank": 0, "coordinates": {"mesh[0]": [0]}},
                                 {"rank": 1, "coordinates": {"mesh[0]": [1]}}]
    assert manifest["process_groups"] == [{"mesh": "mesh[0]", "axis": 0, "groups": [[0, 1]]}]
    assert manifest["collectives"] == ["tvm_distx.ccl.allreduce"]
    main = manifest["functions"]["main"]
    assert main["entries"] == ["main", "main"] and main["weights"] == ["A", "B"]
    assert [(p["name"], p["placement"]) for p in main["params"]] == [
        ("x", "R"), ("A", "S[1]"), ("B", "S[0]")]
    _, A, B = data
    # one safetensors file per rank, holding only its shards: A's columns, B's rows
    files = {f["rank"]: f for f in manifest["weight_files"]}
    assert [files[r]["file"] for r in (0, 1)] == ["weights/rank0.safetensors",
                                                  "weights/rank1.safetensors"]
    assert files[1]["weights"] == [{"name": "A", "shape": [128, 64], "dtype": "float32"},
                                   {"name": "B", "shape": [64, 128], "dtype": "float32"}]
    rank0, rank1 = (load_file(bundle / files[r]["file"]) for r in (0, 1))
    np.testing.assert_array_equal(rank1["A"], A[:, 64:])
    np.testing.assert_array_equal(rank0["B"], B[:64])
    assert files[1]["sha256"] == sha256_file(bundle / files[1]["file"])
    # a rank reads its shards memory-mapped, not copied
    mapped = read_manifest(bundle).read_weight(1, "A")
    assert isinstance(mapped.base, np.memmap) or isinstance(mapped, np.memmap)
    np.testing.assert_array_equal(mapped, A[:, 64:])
    check_weights(read_manifest(bundle))


def edit_manifest(bundle: Path, change) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage,message", [
    (lambda b: (b / "manifest.json").unlink(), "manifest.json is missing"),
    (lambda b: (b / "manifest.json").write_text('{"format": "tvm-distx-bundle", "vers'),
     "not valid JSON"),
    (lambda b: edit_manifest(b, lambda d: d.pop("version")), "manifest version None"),
    (lambda b: edit_manifest(b, lambda d: d.update(version=7)), "manifest version 7"),
    (lambda b: edit_manifest(b, lambda d: d.update(format="other")), "not a tvm-distx manifest"),
    (lambda b: edit_manifest(b, lambda d: d.pop("weight_files")), "no 'weight_files'"),
    (lambda b: edit_manifest(b, lambda d: d["functions"]["main"]["entries"].pop()),
     "lists 1 entries for 2 ranks"),
], ids=["missing", "truncated", "no-version", "unknown-version", "format", "field", "entries"])
def test_a_broken_manifest_is_refused(bundle, damage, message):
    damage(bundle)
    with pytest.raises(td.errors.BundleError, match=message):
        launch(bundle, [np.zeros((128, 128), "float32")])


def test_a_tampered_missing_or_misshapen_weight_is_refused_before_any_rank_runs(bundle):
    path = bundle / "weights" / "rank1.safetensors"
    original = path.read_bytes()
    shards = load_file(path)
    save_file({**shards, "A": np.ones((128, 64), "float32")}, path)
    with pytest.raises(td.errors.BundleError, match="weight 'A' of rank 1 .* does not match its sha256"):
        check_weights(read_manifest(bundle))
    path.write_bytes(original)
    check_weights(read_manifest(bundle))
    # the manifest and the file agree, but not with the program's local shape
    save_file({**shards, "A": np.ones((128, 32), "float32")}, path)

    def reshape(d):
        entry = [f for f in d["weight_files"] if f["rank"] == 1][0]
        entry["sha256"] = sha256_file(path)
        entry["weights"][0]["shape"] = [128, 32]

    edit_manifest(bundle, reshape)
    with pytest.raises(td.errors.BundleError, match="local shape \\[128, 64\\] on rank 1"):
        check_weights(read_manifest(bundle))
    # a file that is no safetensors file, with its sha256 recorded
    path.write_bytes(b"\xff" * 64)
    edit_manifest(bundle, lambda d: d["weight_files"][1].update(sha256=sha256_file(path)))
    with pytest.raises(td.errors.BundleError, match="weight 'A' of rank 1 .* is not a valid safetensors"):
        check_weights(read_manifest(bundle))
    path.unlink()
    with pytest.raises(td.errors.BundleError, match="weight 'A' of rank 1 .* is missing"):
        launch(bundle, [np.zeros((128, 128), "float32")])


def test_a_bundle_can_link_a_checkpoint_that_each_rank_reads_itself(exe, data, tmp_path):
    from tvm_distx.sources.checkpoint import open_checkpoint

    x, A, B = data
    save_file({"A": A, "B": B}, tmp_path / "model.safetensors")
    bundle = exe.export(tmp_path / "linked", params=open_checkpoint(tmp_path),
                        link_checkpoint=True)
    manifest = read_manifest(bundle)
    assert manifest.weight_files == () and [
        (link.rank, link.name, link.start, link.stop) for link in manifest.weight_links] == [
        (0, "A", (0, 0), (128, 64)), (0, "B", (0, 0), (64, 128)),
        (1, "A", (0, 64), (128, 128)), (1, "B", (64, 0), (128, 128))]
    np.testing.assert_allclose(launch(bundle, [x], backend="disco"), mlp_twice(x, A, B),
                               atol=1e-5)
    # a block the checkpoint no longer has, and a checkpoint gone
    save_file({"A": A[:, :96], "B": B}, tmp_path / "model.safetensors")
    with pytest.raises(td.errors.BundleError, match="weight 'A' of rank 1 .* has no block"):
        check_weights(read_manifest(bundle))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(td.errors.BundleError, match="(?s)checkpoint file is missing.*same path on every"):
        launch(bundle, [x])


@pytest.mark.parametrize("damage,message", [
    (lambda b: edit_manifest(b, lambda d: d.update(library="../../../../bin/ls")),
     "the library is '../../../../bin/ls', outside the bundle"),
    (lambda b: edit_manifest(b, lambda d: d["weight_files"][0].update(file="/etc/passwd")),
     "weight 'A' of rank 0 is '/etc/passwd', outside the bundle"),
    (lambda b: (b / "lib.so").write_bytes((b / "lib.so").read_bytes()[:10]),
     "is not a shared library"),
    (lambda b: (b / "lib.so").write_bytes((b / "lib.so").read_bytes() + b"\0"),
     "library .* does not match its sha256"),
    (lambda b: (b / "lib.so").write_bytes(_elf_for_machine((b / "lib.so").read_bytes(), 243)),
     "built for riscv64, and this host is x86_64"),
], ids=["library-escapes", "weight-escapes", "truncated-library", "changed-library",
        "other-architecture"])
def test_a_library_that_cannot_run_here_is_refused_before_launching(bundle, damage, message):
    damage(bundle)
    with pytest.raises(td.errors.BundleError, match=message):
        launch(bundle, [np.zeros((128, 128), "float32")])


def _elf_for_machine(library: bytes, machine: int) -> bytes:
    """The library with its ELF header's machine changed (as a cross-built one has it)."""
    return library[:18] + machine.to_bytes(2, "little") + library[20:]


def test_a_wrong_rank_count_is_refused_before_launching(bundle):
    with pytest.raises(td.errors.BundleError, match="needs 2 ranks, not 4") as info:
        launch(bundle, [np.zeros((128, 128), "float32")], num_ranks=4)
    assert "-n 2" in str(info.value)


@pytest.mark.parametrize("args,kwargs,message", [
    ((), {}, "takes 3 positional input\\(s\\) \\(x, A, B\\), got 0"),
    ((np.zeros((128, 128), "float32"),), {"params": {"C": 1}}, "no parameter named C"),
    ((np.zeros((64, 128), "float32"),), {"params": {"A": np.zeros((128, 128), "float32"),
                                                    "B": np.zeros((128, 128), "float32")}},
     "input 'x' of 'main' has shape \\(64, 128\\), expected \\(128, 128\\)"),
    ((np.zeros((128, 128), "float64"),) * 3, {}, "has dtype float64, expected float32"),
    ((np.zeros((128, 128), "float32"),) * 3, {"backend": "nccl"}, "unknown backend 'nccl'"),
    ((np.zeros((128, 128), "float32"),) * 3, {"function": "mlp"}, "no public function 'mlp'"),
])
def test_bad_run_arguments_name_the_parameter(exe, args, kwargs, message):
    with pytest.raises(td.errors.ArgumentError, match=message):
        exe.run(*args, **{"backend": "emulate", **kwargs})


def test_rvv_programs_are_refused_on_this_host():
    exe = td.compile(tensor_parallel(), target="rvv", schedule=False)
    with pytest.raises(td.errors.ArgumentError, match="cannot run on this host"):
        exe.run(*[np.zeros((128, 128), "float32")] * 3, backend="emulate")


def test_cli_errors_are_one_line_with_a_hint_and_conventional_exit_codes(bundle, tmp_path,
                                                                         capsys):
    assert cli(["run", str(tmp_path / "nowhere"), "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tvm-distx: error: [bundle]") and "hint:" in err
    assert "Traceback" not in err
    assert cli(["run", str(bundle), "-n", "3"]) == 2
    assert "needs 2 ranks, not 3" in capsys.readouterr().err
    assert cli(["run", str(bundle)]) == 2  # no -n: the bundle's count; but no input given
    err = capsys.readouterr().err
    assert "-n" not in err.splitlines()[0] and "input" in err, err


def test_disco_backend_gives_the_emulators_numbers_bit_for_bit(exe, data):
    x, A, B = data
    disco = exe.run(x, params={"A": A, "B": B}, backend="disco")
    np.testing.assert_array_equal(disco, exe.run(x, params={"A": A, "B": B}, backend="emulate"))
    np.testing.assert_allclose(disco, mlp_twice(x, A, B), atol=1e-5)


@pytest.mark.parametrize("example,rule", [
    ("seed_mesh2x2.py", ShardingRule(callee="mlp", args={0: "S[0]R", 1: "RS[1]", 2: "RS[0]"})),
    ("seed_pipeline.py", ShardingRule(callee="mlp", args={0: "R"},
                                      meshes=["mesh[0]", "mesh[1]"])),
], ids=["2x2-on-4-workers", "pipeline-on-2-workers"])
def test_disco_runs_the_2x2_mesh_and_the_pipeline(example, rule, data):
    exe = td.compile(AnnotateSharding([rule])(td.load_module(DATA / example)))
    np.testing.assert_allclose(exe.run(*data, backend="disco"), mlp_twice(*data),
                               rtol=1e-5, atol=1e-5)
