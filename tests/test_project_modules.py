"""`find_project`: the project modules an entry script imports, resolved as Python would."""

from __future__ import annotations

from pathlib import Path

from ddpify.analysis.project import find_project, project_root


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_follows_packages_submodules_and_relative_imports(tmp_path):
    _tree(
        tmp_path,
        {
            "pyproject.toml": "",
            "train.py": "import torch\nimport utils\nfrom models import resnet\nfrom trainer.trainer import Trainer\n",
            "utils.py": "import numpy as np\n",
            "models/__init__.py": "from .vgg import VGG\n",
            "models/vgg.py": "import torch.nn as nn\n",
            "models/resnet.py": "from ..utils import x\nfrom . import vgg\n",
            "trainer/__init__.py": "",
            "trainer/trainer.py": "from base.base_trainer import BaseTrainer\nfrom .. import utils\n",
            "base/__init__.py": "from .base_trainer import *\n",
            "base/base_trainer.py": "import os\n",
            "unused.py": "import train\n",
        },
    )
    project = find_project(tmp_path / "train.py")
    names = {path.relative_to(tmp_path).as_posix(): name for path, name in project.modules.items()}
    assert names == {
        "train.py": "__main__",
        "utils.py": "utils",
        "models/__init__.py": "models",
        "models/vgg.py": "models.vgg",
        "models/resnet.py": "models.resnet",
        "trainer/__init__.py": "trainer",
        "trainer/trainer.py": "trainer.trainer",
        "base/__init__.py": "base",
        "base/base_trainer.py": "base.base_trainer",
    }
    assert project.root == tmp_path.resolve()


def test_entry_in_a_subfolder_reaches_the_root_package(tmp_path):
    """`projects/chargpt/chargpt.py` importing `mingpt` (run with the repository root on the path)."""
    _tree(
        tmp_path,
        {
            "setup.py": "",
            "projects/chargpt/chargpt.py": "from mingpt.trainer import Trainer\nfrom mingpt.utils import set_seed\n",
            "mingpt/__init__.py": "",
            "mingpt/trainer.py": "import torch\n",
            "mingpt/utils.py": "",
        },
    )
    entry = tmp_path / "projects" / "chargpt" / "chargpt.py"
    assert project_root(entry) == tmp_path.resolve()
    found = {p.relative_to(tmp_path).as_posix() for p in find_project(entry).files}
    assert found == {"projects/chargpt/chargpt.py", "mingpt/__init__.py", "mingpt/trainer.py", "mingpt/utils.py"}


def test_never_leaves_the_project(tmp_path):
    """A name found outside the root (a sibling folder, site-packages) is not part of the project."""
    _tree(tmp_path, {"outside.py": "", "proj/.git/HEAD": "", "proj/train.py": "import outside\nimport torch\nimport os\n"})
    project = find_project(tmp_path / "proj" / "train.py")
    assert project.files == [(tmp_path / "proj" / "train.py").resolve()]


def test_an_entry_inside_a_package_with_no_marker_has_the_folder_above_it_as_root(tmp_path):
    """`toolkit/run.py` imports `toolkit.layers` (an unpacked archive: no .git, no pyproject):
    the root is the folder above the package, so `-o DIR/` keeps `DIR/toolkit/`."""
    package = tmp_path / "unpacked" / "toolkit"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text("def make():\n    return 1\n")
    (package / "run.py").write_text("from toolkit.layers import make\nmake()\n")
    assert project_root(package / "run.py") == (tmp_path / "unpacked").resolve()
    project = find_project(package / "run.py")
    assert {p.relative_to(project.root).as_posix() for p in project.files} >= {"toolkit/run.py", "toolkit/layers.py"}
