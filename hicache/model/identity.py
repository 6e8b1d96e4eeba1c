"""A model's default name for page keys: what tells two checkpoints of one architecture apart.

Page keys are seeded by the model name (`index.keys.Namespace.model`), so two fine-tunes of
one architecture must get different names, or one would be served the other's KV. The
layout alone cannot tell them apart (equal geometry), and neither can `model_type`.

`model_identity(path, layout, config=None)` picks, in order:

1. where the config was read from, as an absolute path: the checkpoint folder of a
   `config.json` (a Hugging Face hub cache folder, `.../models--org--name/snapshots/<rev>`,
   becomes `org/name@<rev>`), or the file itself when it has another name (a folder of
   renamed configs, such as `configs/models/`, holds many models). Each fine-tune lives in
   its own folder, and a hub revision pins the weights, so this never merges two
   checkpoints; at worst one checkpoint mounted at two paths gets two names (a missed
   share, never a wrong one).
2. the config's `_name_or_path`, when no path is known. transformers 4.x wrote it on save
   as the name the model was *loaded* from, often the base model, so two fine-tunes saved
   from one base can carry the same value; that is why it comes after the folder.
3. the layout's `model_type`: the weakest, shared by every checkpoint of the family. A
   deployment serving several of them must name each model explicitly.

Pure: no torch, no reads; `Path.resolve` only normalises the path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache.model.layout import ModelLayout

_HUB_PREFIX = "models--"


def model_identity(
    path: Path | None, layout: ModelLayout, config: Mapping[str, Any] | None = None
) -> str:
    """The default model name for page keys (see the module docstring for the order).

    `path` is the config.json (or the checkpoint folder) the layout was read from; a YAML
    layer list or deployment file is not a checkpoint and is skipped. `config` is the
    parsed config.json, if the caller has it (read only when `path` gives no folder).
    """
    where = checkpoint_path(path) if path is not None else None
    if where is not None:
        return hub_name(where) or str(where)
    if config is not None:
        name = config.get("_name_or_path")
        if isinstance(name, str) and name.strip():
            return name.strip()
    return layout.model_type


def checkpoint_path(path: Path) -> Path | None:
    """The absolute path that names a checkpoint: the folder of a `config.json` (or the
    folder itself), the file for any other `.json`, None for a YAML file (not a checkpoint).

    Folders are resolved, files are not followed: in a hub cache `config.json` is a link into
    `blobs/`, and the snapshot folder is what names the revision."""
    if path.suffix in {".yaml", ".yml"}:
        return None
    if path.name == "config.json":
        return path.parent.resolve()
    if path.suffix == ".json":
        return path.parent.resolve() / path.name
    return path.resolve()


def hub_name(folder: Path) -> str | None:
    """`org/name@revision` for a hub cache snapshot folder, else None."""
    snapshots, repo = folder.parent, folder.parent.parent
    if snapshots.name != "snapshots" or not repo.name.startswith(_HUB_PREFIX):
        return None
    repo_id = repo.name[len(_HUB_PREFIX) :].replace("--", "/", 1)
    return f"{repo_id}@{folder.name}" if repo_id else None
