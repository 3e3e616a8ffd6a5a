"""strata.torch: DeepSpeed's checkpoint behaviour around the engine's atomic
save (offload/src/checkpoint_io.cpp): saving into an existing tag replaces
it, and loading from a folder with nothing saved is (None, None) with a
warning.

Note [Replacing a checkpoint tag]
The engine's save never overwrites: it writes a .tmp-* folder, makes it
durable, renames it to its tag and then points `latest` at it, and refuses
a tag that exists. DeepSpeed scripts save into one tag again and again, so
strata.torch replaces an existing save_dir/TAG this way:
  1. the engine saves TAG into save_dir/.replace-TAG (synchronously): a
     complete, durable checkpoint whose manifest names TAG;
  2. rank 0 swaps the two folders in one rename (renameat2's
     RENAME_EXCHANGE): save_dir/TAG is the new checkpoint, the old one is
     in the staging folder;
  3. rank 0 points save_dir/latest at TAG (written atomically), then
     removes the staging folder.
Killed before 2, save_dir/TAG and `latest` are the old checkpoint's; after
2, `latest` names a complete checkpoint (TAG, now the new one, or the tag it
named before). A file system that cannot swap folders atomically is found
by a probe in save_dir before anything is saved, and the save is refused.
A replaced tag prunes nothing (keep counts tags, and none was added).
"""

import ctypes
import errno
import os
import re
import shutil
import warnings

from .errors import Unsupported

__all__ = ["save_checkpoint", "nothing_to_load", "loaded_path"]

_TAG = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _is_valid_tag(tag):
    """The engine's rule (check_checkpoint_tag): only then is save_dir/tag a path inside save_dir."""
    return bool(_TAG.fullmatch(tag)) and not tag.startswith(".") and tag != "latest"


def _exchange(first, second):
    libc = ctypes.CDLL(None, use_errno=True)
    rename = getattr(libc, "renameat2", None)
    if rename is None:
        raise OSError(errno.ENOSYS, "this C library has no renameat2")
    rename.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rename.restype = ctypes.c_int
    if rename(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), first)


def _fsync_folder(folder):
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(folder, name, text):
    temporary = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(folder, name))
    _fsync_folder(folder)


def _check_folders_swap(save_dir, tag, rank):
    """Refuses, before anything is saved, a file system that cannot swap two folders in one rename."""
    probe = os.path.join(save_dir, f".replace-probe-{rank}-{os.getpid()}")
    shutil.rmtree(probe, ignore_errors=True)
    os.makedirs(os.path.join(probe, "a"))
    os.makedirs(os.path.join(probe, "b"))
    try:
        _exchange(os.path.join(probe, "a"), os.path.join(probe, "b"))
    except OSError as e:
        raise Unsupported(f"checkpoint tag '{tag}' exists in '{save_dir}', and replacing it needs the file system to "
                          f"swap two folders in one rename (renameat2 RENAME_EXCHANGE) so that the old checkpoint "
                          f"stays loadable until the new one is durable; here that fails ({e.strerror}): give "
                          f"another tag, or remove '{os.path.join(save_dir, tag)}' first") from None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def save_checkpoint(engine, save_dir, tag, keep, sync, app_text):
    """The engine's (strata.engine.Engine) save of tag ("" : global_step<N>) into save_dir, replacing an existing
    tag (Note [Replacing a checkpoint tag]); every rank calls it."""
    name = tag or f"global_step{engine.steps_begun}"
    existing = os.path.join(save_dir, name)
    if not (_is_valid_tag(name) and os.path.isdir(existing) and not os.path.islink(existing)):
        engine.save_checkpoint(save_dir, tag, keep, sync, app_text)  # a new tag (or one the engine refuses by name)
        return
    rank = engine.rank
    staging = os.path.join(save_dir, f".replace-{name}")
    if rank == 0 and os.path.lexists(staging):  # an interrupted replacement's leftovers
        shutil.rmtree(staging) if os.path.isdir(staging) and not os.path.islink(staging) else os.unlink(staging)
    _check_folders_swap(save_dir, name, rank)
    engine.save_checkpoint(staging, name, 0, True, app_text)
    if rank != 0:
        return
    _exchange(os.path.join(staging, name), existing)
    _fsync_folder(save_dir)
    _write_atomically(save_dir, "latest", name + "\n")
    shutil.rmtree(staging)


def nothing_to_load(load_dir, tag):
    """DeepSpeed's "nothing to load": no tag given and load_dir holds no `latest` (nor is itself a tag's
    folder). Warns, as DeepSpeed does, and returns True then."""
    if tag is not None:
        return False
    if os.path.isfile(os.path.join(load_dir, "latest")) or os.path.isfile(os.path.join(load_dir, "manifest.json")):
        return False
    warnings.warn(f"load_checkpoint('{load_dir}'): no '{os.path.join(load_dir, 'latest')}' file, so nothing was "
                  f"loaded (returned (None, None), as DeepSpeed does); to load a particular checkpoint pass its tag",
                  RuntimeWarning, stacklevel=3)
    return True


def loaded_path(load_dir, tag, loaded_tag):
    """The folder of the checkpoint loaded: DeepSpeed's load_path, what load_checkpoint returns first."""
    if tag:
        return os.path.join(load_dir, tag)
    if os.path.isfile(os.path.join(load_dir, "manifest.json")):
        return load_dir
    return os.path.join(load_dir, loaded_tag)
