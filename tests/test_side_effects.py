"""The writers classification (`analysis.side_effects`): what convert guards to rank 0 and check flags."""

from __future__ import annotations

import textwrap

import pytest

from ddpify.engine import convert_source

PRELUDE = """
import torch
from torch.utils.data import DataLoader
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
for epoch in range(2):
    for x in loader:
        model(x.float().view(-1, 1).repeat(1, 2)).sum().backward()
        optimizer.step()
"""

WRITES = {
    "PIL image": ("from PIL import Image", "    Image.fromarray(x.numpy()).save(f'e{epoch}.png')"),
    "PIL through a name": ("from PIL import Image", "    img = Image.new('RGB', (2, 2))\n    img.save('a.png')"),
    "imageio": ("import imageio", "    imageio.imwrite('a.png', x.numpy())"),
    "imageio video": ("import imageio", "    imageio.mimsave('a.gif', [x.numpy()])"),
    "cv2": ("import cv2", "    cv2.imwrite('a.png', x.numpy())"),
    "skimage": ("from skimage import io", "    io.imsave('a.png', x.numpy())"),
    "soundfile": ("import soundfile as sf", "    sf.write('a.wav', x.numpy(), 16000)"),
    "scipy wav": ("from scipy.io import wavfile", "    wavfile.write('a.wav', 16000, x.numpy())"),
    "torchaudio": ("import torchaudio", "    torchaudio.save('a.wav', x.view(1, -1).float(), 16000)"),
    "save_image": ("from torchvision.utils import save_image", "    save_image(x.float(), 'a.png')"),
    "numpy": ("import numpy as np", "    np.savetxt('a.txt', x.numpy())"),
    "yaml": ("import yaml", "    yaml.safe_dump({'e': epoch}, open('a.yml', 'w'))"),
    "pandas": ("import pandas as pd", "    pd.DataFrame({'e': [epoch]}).to_parquet('a.parquet')"),
    "pathlib": ("from pathlib import Path", "    Path('a.txt').write_text(str(epoch))"),
    "tensorboard_logger": ("from tensorboard_logger import log_value", "    log_value('loss', 1.0, epoch)"),
    "mlflow": ("import mlflow", "    mlflow.log_metric('loss', 1.0)"),
    "neptune": ("import neptune", "    neptune.log_metric('loss', 1.0)"),
    "visdom": ("import visdom", "    visdom.Visdom().line([1.0])"),
    "comet": ("import comet_ml", "    comet_ml.log_metric('loss', 1.0)"),
    "tqdm.write": ("from tqdm import tqdm", "    tqdm.write(f'epoch {epoch}')"),
    "a bar's write": ("from tqdm import tqdm", "    bar = tqdm(range(3))\n    bar.write(f'epoch {epoch}')"),
    "sys.stdout.write": ("import sys", "    sys.stdout.write(f'[{epoch}] done')"),
    "logging.config.dictConfig": ("import logging.config", "    logging.config.dictConfig({'version': 1})"),
    "wave opened to write": ("import wave", "    with wave.open(f'e{epoch}.wav', 'wb') as clip: clip.writeframes(b'')"),
    "a library's writer, by its name": ("from audiokit.io import save_clip", "    save_clip('out' + f'/e{epoch}.wav', x.numpy())"),
    "a library's method, by its name": ("import meshlib", "    meshlib.Mesh().export_obj(f'e{epoch}.json')"),
    "matplotlib imsave": ("import matplotlib.pyplot as plt", "    plt.imsave(f'e{epoch}.png', x.numpy())"),
}


@pytest.mark.parametrize("kind", WRITES)
def test_writer_runs_on_rank_zero(kind):
    imports, write = WRITES[kind]
    source = textwrap.dedent(PRELUDE).replace("import torch\n", f"import torch\n{imports}\n", 1) + write + "\n"
    result = convert_source(source, "train.py")
    lines = result.code.splitlines()
    at = next(i for i, line in enumerate(lines) if write.strip().splitlines()[-1].strip() in line)
    size = len(write.strip().splitlines())  # an image made only to be saved goes with its save
    guards = [lines[at - 1].strip(), lines[at - size].strip()]
    assert any("get_rank() == 0" in g or "RANK" in g for g in guards), "\n".join(lines[at - 3 : at + 1])


@pytest.mark.parametrize(
    "call", ["load_clip(f'e{epoch}.wav')", "save_clip(path_of(epoch))", "store.save_or_load(f'e{epoch}.pt')"]
)  # fmt: skip
def test_a_library_call_that_reads_or_names_no_file_stays_on_every_rank(call):
    """A library's function is a writer by its name only with an output file's name among its
    arguments, and no word of its name reads (load, read, open, get...)."""
    source = "from audiokit import load_clip, save_clip, path_of, store\n" + textwrap.dedent(PRELUDE) + f"    {call}\n"
    code = convert_source(source, "train.py").code
    assert f"\n    {call}\n" in code, code


def test_a_figure_is_drawn_where_it_is_saved():
    """The statements that draw a figure beside its save run on rank 0 with it, and a loop that
    only draws and saves is guarded whole; a statement that trains is never taken along."""
    source = "import matplotlib.pyplot as plt\n" + textwrap.dedent(PRELUDE) + textwrap.dedent("""
        for i in range(2):
            plt.figure()
            plt.plot([i, epoch])
            plt.savefig(f'p{i}.png')
            plt.close()
        fig, ax = plt.subplots()
        ax.plot([1, 2])
        fig.savefig('final.png')
        plt.close(fig)
    """)
    code = convert_source(source, "train.py").code
    assert "if dist.get_rank() == 0:\n    for i in range(2):\n        plt.figure()" in code, code
    assert "\n    fig, ax = plt.subplots()\n    ax.plot([1, 2])\n    fig.savefig('final.png')\n    plt.close(fig)\n" in code, code  # the same `if`


def test_a_read_stays_on_every_rank():
    source = textwrap.dedent(PRELUDE) + "    img = __import__('PIL').Image.open('a.png')\n"
    result = convert_source("from PIL import Image\n" + source, "train.py")
    assert "Image.open" in result.code and "get_rank() == 0:\n        img" not in result.code


@pytest.mark.parametrize(
    "client",
    ["from visdom import Visdom\nboard = Visdom()", "import comet_ml\nboard = comet_ml.Experiment()",
     "import aim\nboard = aim.Run()", "import neptune\nboard = neptune.init_run()"],
)  # fmt: skip
def test_a_tracker_client_is_made_and_used_on_rank_zero(client):
    """A tracking service's client object (`viz = Visdom()`, then `viz.line(...)`): made on rank
    0 only, as a SummaryWriter is, and every statement that reads it runs there."""
    imports, made = client.split("\n")
    source = textwrap.dedent(PRELUDE).replace("import torch\n", f"import torch\n{imports}\n{made}\n", 1)
    source += "    board.log_metric('epoch', epoch)\n"
    code = convert_source(source, "train.py").code
    made_on_rank0 = (f"{made} if dist.get_rank() == 0 else None", f'{made} if int(os.environ.get("RANK", 0)) == 0 else None')
    assert any(line in code for line in made_on_rank0), code  # (made before the group: the RANK torchrun sets)
    assert "    if dist.get_rank() == 0:\n        board.log_metric('epoch', epoch)" in code, code
