"""What writes files or logs: the one classification `convert` and `check` read.

Output meant once per job is recognised by what a call is, not by a short list of spellings:

| kind | recognised |
| --- | --- |
| functions that write a file | removing or moving one (`os.remove`, `os.rename`, `shutil.rmtree`, `shutil.move`: every rank would race to the same file), `torch.save`, `torchvision.utils.save_image`, numpy `save`/`savez`/`savetxt`, `json`/`pickle`/`yaml` dump, `shutil` copies, `matplotlib.pyplot.savefig`, image writers (imageio, cv2, skimage), audio and video writers (`soundfile.write`, `scipy.io.wavfile.write`, `torchaudio.save`, `imageio.mimsave`, `torchvision.io.write_video`) |
| messages | `tqdm.write` (a print that keeps the bars intact), `sys.stdout.write` (progress bars drawn by hand) |
| logging set up | `logging.basicConfig`, `logging.config.dictConfig`/`fileConfig`: on rank 0 only, so the other ranks' loggers print warnings and errors alone (Python's last-resort handler) |
| tracking and logging libraries | every function of TensorBoard (`torch.utils.tensorboard`, tensorboardX, `tensorboard_logger`), W&B, MLflow, Neptune, Comet, ClearML, Aim and visdom |
| writer methods on any object | `savefig`, pandas `to_csv`/`to_json`/`to_parquet`/..., csv `writerow(s)`, `save_pretrained`, pathlib `write_text`/`write_bytes` |
| methods of a library's objects | `.save(...)`/`.write(...)` on what PIL, imageio, h5py, soundfile, matplotlib or tqdm made (`Image.fromarray(a).save(path)`, `bar = tqdm(loader)` then `bar.write(msg)`) |
| functions of other libraries | a call whose name says it writes (`save_sample`, `write_wav`, `export`) and that gets a file name of an output kind (`root / ("clip_%d.wav" % i)`, `f"{out}/{i}.png"`): `writes_named_file` |

Prints, logging calls, `open(..., "w")` and objects made by the libraries above (a
`SummaryWriter`, a W&B run) are handled where they are used (`guard_rank_zero`, `multinode`).
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis import names as N

WRITE_FUNCTIONS = frozenset(
    {"torch.save", "torch.serialization.save", "torchvision.utils.save_image", "numpy.save", "numpy.savez",
     "numpy.savez_compressed", "numpy.savetxt", "json.dump", "pickle.dump", "yaml.dump", "yaml.safe_dump",
     "shutil.copyfile", "shutil.copy", "shutil.copy2", "shutil.copytree", "matplotlib.pyplot.savefig",
     "imageio.imwrite", "imageio.imsave", "imageio.mimsave", "imageio.mimwrite", "imageio.v2.imwrite",
     "imageio.v3.imwrite", "cv2.imwrite", "skimage.io.imsave", "scipy.misc.imsave", "soundfile.write",
     "scipy.io.wavfile.write", "torchaudio.save", "torchvision.io.write_video", "torchvision.io.write_png",
     "torchvision.io.write_jpeg", "logging.basicConfig", "logging.config.dictConfig",
     "logging.config.fileConfig", "matplotlib.pyplot.imsave", "librosa.output.write_wav", "torch.jit.save",
     "joblib.dump", "torch.onnx.export", "torchvision.io.write_file", "imageio.v2.imsave", "imageio.v2.mimsave",
     "imageio.v3.imwrite", "tifffile.imwrite", "marshal.dump", "plistlib.dump", "toml.dump", "tqdm.write", "tqdm.tqdm.write", "tqdm.auto.tqdm.write",
     "tqdm.std.tqdm.write", "sys.stdout.write", "os.remove", "os.unlink", "os.rename", "os.replace", "shutil.rmtree",
     "shutil.move"}
)  # fmt: skip
TRACKER_MODULES = ("torch.utils.tensorboard", "tensorboardX", "tensorboard_logger", "wandb", "mlflow", "neptune",
                   "comet_ml", "clearml", "aim", "visdom")  # fmt: skip
# Reads that these libraries' modules also offer: not output.
_TRACKER_READS = ("wandb.Api", "mlflow.get_", "mlflow.search_", "mlflow.load", "wandb.restore")
WRITE_METHODS = frozenset(
    {"savefig", "to_csv", "to_json", "to_parquet", "to_pickle", "to_excel", "to_hdf", "to_feather", "writerow",
     "writerows", "save_pretrained", "addHandler", "write_text", "write_bytes", "tofile", "to_html", "to_latex"}
)  # fmt: skip
LIBRARY_OBJECTS = ("PIL.", "imageio.", "h5py.", "soundfile.", "matplotlib.", "cv2.", "tqdm.")  # tqdm: `bar.write(msg)`
LIBRARY_WRITE_METHODS = frozenset({"save", "write", "imwrite", "savefig", "create_dataset", "close_and_save"})


def writes(qnames: frozenset[str], name: str, receiver_roots: frozenset[str] = frozenset(), method: bool = False) -> bool:
    """Is a call output meant once per job? `qnames`: what the callee may be; `name`: its last
    component; `receiver_roots`: the qualified names at the root of its receiver
    (`PIL.Image.fromarray` for `Image.fromarray(a).save(p)`); `method`: it has a receiver."""
    if qnames & WRITE_FUNCTIONS or qnames & N.TORCH_SAVE:
        return True
    if any(q.startswith(m + ".") or q == m for q in qnames for m in TRACKER_MODULES) and not any(
        q.startswith(_TRACKER_READS) for q in qnames
    ):
        return True
    if method and name in WRITE_METHODS:
        return True
    return name in LIBRARY_WRITE_METHODS and any(q.startswith(LIBRARY_OBJECTS) for q in receiver_roots)


_OUTPUT_FILE = re.compile(r"\.(%s)[\"']" % "|".join(sorted(N.OUTPUT_SUFFIXES)), re.IGNORECASE)


def writes_named_file(name: str, args: list[str]) -> bool:
    """Does a call of a function the analysis cannot follow (a library's) write a file? Its
    name has a word that writes and none that reads (`save_sample`, not `load_or_save`), and
    the code of one of `args` names a file of an output kind (`"clip_%d.wav" % i`)."""
    words = set(re.findall(r"[a-z]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()))
    return bool(words & N.WRITER_WORDS) and not words & N.READER_WORDS and any(_OUTPUT_FILE.search(a) for a in args)


def receiver_root(node: cst.BaseExpression | None) -> cst.BaseExpression | None:
    """The name a receiver chain starts from: `Image` in `Image.fromarray(a).convert("L")`."""
    while node is not None and not isinstance(node, cst.Name):
        if isinstance(node, cst.Call):
            node = node.func
        elif isinstance(node, (cst.Attribute, cst.Subscript)):
            node = node.value
        else:
            return None
    return node


def bound_call_roots(qnames_of, assigns, receiver: cst.BaseExpression | None) -> frozenset[str]:
    """The qualified names at the root of a receiver, also through one local name bound to a
    call (`img = Image.fromarray(a)` then `img.save(path)`): `qnames_of(node)` resolves a name,
    `assigns` are the assignments of the call's scope."""
    root = receiver_root(receiver)
    if root is None:
        return frozenset()
    found = set(qnames_of(root))
    for assign in assigns:
        target = assign.targets[0].target
        if isinstance(target, cst.Name) and target.value == root.value and isinstance(assign.value, cst.Call):
            inner = receiver_root(assign.value)
            if inner is not None:
                found |= qnames_of(inner)
    return frozenset(found)
