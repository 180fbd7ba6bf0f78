"""Unit tests for tvm_distx.frontend.script.load_module and ScriptError."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import tvm

import tvm_distx as td
from tvm_distx.errors import ShardingError
from tvm_distx.layout.mesh import device_meshes
from tvm_distx.frontend.script import ScriptError, load_module
from locations import TESTS_DIR

DATA = TESTS_DIR / "data"

# A tiny valid module body shared by the cases below.
IDENTITY_CLASS = """
@I.ir_module
class Identity:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        return x
"""

HEADER = "from tvm.script import ir as I\nfrom tvm.script import relax as R\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def function_names(mod) -> set[str]:
    return {gv.name_hint for gv in mod.get_global_vars()}


# ---------------------------------------------------------------------------- success


class TestLoadsModules:
    def test_seed_pipeline(self):
        mod = load_module(DATA / "seed_pipeline.py")
        assert isinstance(mod, tvm.IRModule)
        assert function_names(mod) == {"main", "mlp"}
        assert list(device_meshes(mod)) == ["mesh[0]", "mesh[1]"]
        assert int(mod.attrs["device_num"]) == 2

    def test_seed_mesh2x2(self):
        mod = load_module(DATA / "seed_mesh2x2.py")
        assert function_names(mod) == {"main", "mlp"}
        meshes = device_meshes(mod)
        assert meshes["mesh[0]"].shape == (2, 2)
        assert int(mod.attrs["device_num"]) == 4

    def test_accepts_a_string_path(self):
        mod = load_module(str(DATA / "seed_mesh2x2.py"))
        assert function_names(mod) == {"main", "mlp"}

    def test_exported_at_top_level(self):
        assert td.load_module is load_module

    def test_private_function_stays_private(self):
        mod = load_module(DATA / "seed_pipeline.py")
        mlp = mod["mlp"]
        # A private Relax function has no global_symbol attribute.
        assert mlp.attrs is None or "global_symbol" not in mlp.attrs
        assert mod["main"].attrs["global_symbol"] == "main"

    def test_minimal_module(self, tmp_path):
        mod = load_module(write(tmp_path, "identity.py", HEADER + IDENTITY_CLASS))
        assert function_names(mod) == {"main"}
        assert device_meshes(mod) == {}

    def test_import_aliases_are_honoured(self, tmp_path):
        text = (
            "from tvm.script import ir as IRB, relax as RX\n"
            + IDENTITY_CLASS.replace("I.", "IRB.").replace("R.", "RX.")
        )
        mod = load_module(write(tmp_path, "aliased.py", text))
        assert function_names(mod) == {"main"}

    def test_default_names_without_imports(self, tmp_path):
        # I and R are bound even when the file does not import them.
        mod = load_module(write(tmp_path, "noimports.py", IDENTITY_CLASS))
        assert function_names(mod) == {"main"}

    def test_file_is_parsed_not_executed(self, tmp_path):
        text = (
            "import a_module_that_does_not_exist_anywhere\n"
            "raise RuntimeError('this file must not run')\n" + HEADER + IDENTITY_CLASS
        )
        mod = load_module(write(tmp_path, "sideeffects.py", text))
        assert function_names(mod) == {"main"}

    def test_functions_and_comments_around_the_class_are_ignored(self, tmp_path):
        text = (
            HEADER
            + "# a comment\n\ndef helper():\n    return 1\n\nVALUE = 3\n"
            + IDENTITY_CLASS
            + "\nprint('trailing')\n"
        )
        mod = load_module(write(tmp_path, "extras.py", text))
        assert function_names(mod) == {"main"}


# ---------------------------------------------------------------------------- failures


class TestScriptErrors:
    def test_error_class(self):
        assert issubclass(ScriptError, ShardingError)
        assert ScriptError.rule == "tvmscript"

    def test_missing_file(self, tmp_path):
        path = tmp_path / "absent.py"
        with pytest.raises(ScriptError) as info:
            load_module(path)
        assert str(info.value) == f"[tvmscript] cannot read {path}: No such file or directory"

    def test_directory(self, tmp_path):
        with pytest.raises(ScriptError) as info:
            load_module(tmp_path)
        assert f"cannot read {tmp_path}" in str(info.value)

    def test_syntax_error(self, tmp_path):
        path = write(tmp_path, "broken.py", HEADER + "def f(:\n    pass\n")
        with pytest.raises(ScriptError) as info:
            load_module(path)
        text = str(info.value)
        assert text.startswith(f"[tvmscript] {path} is not valid Python: line 3: ")

    def test_no_class(self, tmp_path):
        path = write(tmp_path, "empty.py", HEADER + "x = 1\n")
        with pytest.raises(ScriptError) as info:
            load_module(path)
        assert str(info.value) == (
            f"[tvmscript] {path} defines no @I.ir_module class\n"
            "hint: a module file holds one class decorated @I.ir_module, as mod.script() "
            "prints it"
        )

    def test_empty_file(self, tmp_path):
        path = write(tmp_path, "blank.py", "")
        with pytest.raises(ScriptError, match="defines no @I.ir_module class"):
            load_module(path)

    def test_only_the_ir_module_classes_count(self, tmp_path):
        helper = "class Helper:\n    pass\n\n\n"
        path = write(tmp_path, "helped.py", HEADER + helper + IDENTITY_CLASS)
        assert "main" in [gv.name_hint for gv in load_module(path).functions]
        path = write(tmp_path, "helpers.py", HEADER + helper + helper.replace("Helper", "Other"))
        with pytest.raises(ScriptError, match=r"defines no @I.ir_module class \(it has 2 "
                                              r"other classes\)"):
            load_module(path)

    def test_a_pytorch_file_is_named_as_one(self, tmp_path):
        torch_file = ("import torch\n\n\nclass Inner(torch.nn.Module):\n    pass\n\n\n"
                      "class Net(torch.nn.Module):\n    def __init__(self):\n"
                      "        super().__init__()\n        self.inner = Inner()\n")
        path = write(tmp_path, "net.py", torch_file)
        with pytest.raises(ScriptError) as info:
            load_module(path)
        assert str(info.value) == (
            f"[tvmscript] {path} is a PyTorch file (2 torch.nn.Module classes: Inner, Net), "
            "not a TVMScript module\nhint: import the model with tvm_distx.from_torch(Net(), "
            "(example_input,)), which returns the Relax module and its weights")
        assert "the command line reads TVMScript" in info.value.for_cli()

    def test_two_classes(self, tmp_path):
        path = write(
            tmp_path, "two.py", HEADER + IDENTITY_CLASS + IDENTITY_CLASS.replace("Identity", "Other")
        )
        with pytest.raises(ScriptError) as info:
            load_module(path)
        assert "must define exactly one @I.ir_module class, found 2 (Identity, Other)" in \
            str(info.value)

    def test_tvm_parse_error(self, tmp_path):
        body = IDENTITY_CLASS.replace("return x", "return R.no_such_operator(x)")
        path = write(tmp_path, "badop.py", HEADER + body)
        with pytest.raises(ScriptError) as info:
            load_module(path)
        text = str(info.value)
        assert text.startswith(f"[tvmscript] TVM could not parse {path}: ")
        assert "no_such_operator" in text

    def test_tvm_type_error_in_the_module(self, tmp_path):
        body = IDENTITY_CLASS.replace("return x", "return undefined_name")
        path = write(tmp_path, "undefined.py", HEADER + body)
        with pytest.raises(ScriptError, match="TVM could not parse"):
            load_module(path)

    def test_undecorated_class_is_not_a_module(self, tmp_path):
        path = write(tmp_path, "plain.py", "class A:\n    x = 1\n")
        with pytest.raises(ScriptError) as info:
            load_module(path)
        assert str(info.value).startswith("[tvmscript] ")

    def test_non_utf8_file(self, tmp_path):
        # Bytes that are not UTF-8 (and no coding declaration) make the file invalid
        # Python source, which must be reported as a ScriptError, not UnicodeDecodeError.
        path = tmp_path / "latin1.py"
        path.write_bytes(b"# caf\xe9\n" + (HEADER + IDENTITY_CLASS).encode())
        with pytest.raises(ScriptError) as info:
            load_module(path)
        assert str(path) in str(info.value)


def test_a_printed_dtensor_module_loads_back(tmp_path):
    """TVM prints R.DTensor and R.device_mesh, which its own parser only knows under R.dist."""
    import tvm

    from tvm_distx import ShardingRule
    from tvm_distx.passes import AnnotateSharding, PropagateSharding

    mod = load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py")
    mod = PropagateSharding()(AnnotateSharding(
        [ShardingRule(param="A", result="S[1]", function="mlp")])(mod))
    (tmp_path / "printed.py").write_text(mod.script(show_meta=False))
    assert "R.DTensor(" in (tmp_path / "printed.py").read_text()
    tvm.ir.assert_structural_equal(load_module(tmp_path / "printed.py"), mod)
