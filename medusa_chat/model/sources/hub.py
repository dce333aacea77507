"""Hugging Face Hub access: fetch only the files a model needs, show progress, reuse the cache, fail clearly.

Everything goes through huggingface_hub's own cache (`HF_HUB_CACHE`, default `~/.cache/huggingface/hub`), so
models downloaded by other tools are reused and ours are visible to them.

Offline behaviour: with `HF_HUB_OFFLINE=1`, or when a quick reachability probe of the Hub fails, nothing is
requested from the network (huggingface_hub would otherwise spend ~23 s in retries); the cached snapshot is
used if it holds every needed file, and otherwise an `OfflineError` names the repo, the missing files and how
to get them.

Environment variables are read at call time (huggingface_hub reads its own at import), so tests and the UIs
can change `HF_HUB_CACHE` / `HF_HUB_OFFLINE` / `HF_ENDPOINT` at run time.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from medusa_chat.errors import HeadsError, MedusaChatError, ModelNotFoundError, OfflineError
from medusa_chat.model.sources.download_progress import DownloadReporter, Progress
from medusa_chat.units import human_bytes

HEADS_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # safetensors first: no pickle involved
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
DISK_MARGIN_BYTES = 1 << 30  # keep 1 GiB free after a download: a full disk breaks more than this app
_TRUTHY = {"1", "true", "yes", "on"}


# ---- environment ----------------------------------------------------------------------------------------------
def hub_cache_dir() -> Path:
    """The huggingface_hub cache folder, honouring HF_HUB_CACHE / HF_HOME as set right now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


_reachable: dict[str, tuple[bool, float]] = {}
_reachable_lock = threading.Lock()
RETRY_UNREACHABLE_S = 60.0  # a long-running app notices within a minute that the network came back


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick probe of the Hub endpoint (cached per endpoint; a failure is re-probed after a minute).

    Any HTTP answer counts as reachable; only connection failures and timeouts do not. urllib honours the
    usual proxy variables, like huggingface_hub does.
    """
    if offline_mode():
        return False
    endpoint = hub_endpoint()
    with _reachable_lock:
        if endpoint in _reachable:
            ok, when = _reachable[endpoint]
            if ok or time.monotonic() - when < RETRY_UNREACHABLE_S:
                return ok
    try:
        request = urllib.request.Request(f"{endpoint}/api/models?limit=1", method="HEAD")
        with urllib.request.urlopen(request, timeout=timeout):
            ok = True
    except urllib.error.HTTPError:
        ok = True  # the server answered
    except (OSError, ValueError):
        ok = False
    with _reachable_lock:
        _reachable[endpoint] = (ok, time.monotonic())
    return ok


def forget_reachability() -> None:
    """Probe again next time (after the network came back, or in tests)."""
    with _reachable_lock:
        _reachable.clear()


# ---- what to fetch --------------------------------------------------------------------------------------------
def _top_level(names: Iterable[str]) -> list[str]:
    # Subfolders hold other formats (onnx/, original/, gguf variants): never needed here.
    return sorted(n for n in names if "/" not in n)


def weight_files(names: Iterable[str]) -> list[str]:
    """The backbone checkpoint files among `names`: safetensors preferred over pickled .bin.

    Only the transformers naming (`model*.safetensors`, `pytorch_model*.bin`) counts, so extra files such as
    Mistral's `consolidated.safetensors` or a heads file are never pulled in.
    """
    names = _top_level(names)
    st = [n for n in names if fnmatch.fnmatch(n, "model*.safetensors")]
    if st:
        return st + [n for n in names if n == SAFETENSORS_INDEX]
    pt = [n for n in names if fnmatch.fnmatch(n, "pytorch_model*.bin")]
    return pt + [n for n in names if n == BIN_INDEX]


def select_files(names: Iterable[str], want: str) -> list[str]:
    """Which of a repo's files are needed for `want`: "config", "heads", "model" (backbone + tokenizer) or
    "tokenizer" (tokenizer files only).

    Returns [] when the essential file is absent (no config / no heads file / no weights): callers turn that
    into the matching error, because only they know what the repo was supposed to be.
    """
    names = _top_level(names)
    present = set(names)
    if want == "config":
        return [n for n in ("config.json",) if n in present]
    if want == "heads":
        heads = next((f for f in HEADS_FILES if f in present), None)
        # beside the weights: the fitted tree and the draft vocabulary (train-heads writes both)
        beside = [n for n in ("config.json", "tree.json", "draft_vocab.safetensors") if n in present]
        if heads is None:  # an EAGLE draft (model/forward/eagle.py): config.json and one weight file, no tokenizer
            eagle = next((f for f in ("model.safetensors", "pytorch_model.bin") if f in present), None)
            draft = eagle and "config.json" in present and not present & set(TOKENIZER_FILES)
            return [*beside, eagle] if draft else []
        return [*beside, heads]
    if want == "model":
        weights = weight_files(names)
        if not weights or "config.json" not in present:
            return []
        small = [n for n in (*CONFIG_FILES, *TOKENIZER_FILES) if n in present]
        return small + weights
    if want == "tokenizer":
        tok = [n for n in TOKENIZER_FILES if n in present]
        return [n for n in ("config.json",) if n in present] + tok if tok else []
    raise ValueError(f"unknown file set {want!r}")


def missing_shards(folder: Path) -> list[str]:
    """Shards named by a sharded checkpoint's index that are not in `folder`."""
    for index in (SAFETENSORS_INDEX, BIN_INDEX):
        path = folder / index
        if path.is_file():
            try:
                weight_map = json.loads(path.read_text()).get("weight_map", {})
            except (OSError, json.JSONDecodeError, AttributeError):
                return [index]
            return sorted({f for f in weight_map.values() if not (folder / f).is_file()})
    return []


# ---- cache inspection -----------------------------------------------------------------------------------------
@dataclass
class CachedRepo:
    repo_id: str
    size_on_disk: int
    files: set[str] = field(default_factory=set)
    snapshot: Path | None = None  # the snapshot `refs/main` points at, if any


def cached_repos() -> dict[str, CachedRepo]:
    """Model repos in the local HF cache (no network). Empty when there is no cache yet."""
    import huggingface_hub.errors
    from huggingface_hub import scan_cache_dir

    cache = hub_cache_dir()
    if not cache.is_dir():
        return {}
    try:
        info = scan_cache_dir(cache)
    except getattr(huggingface_hub.errors, "CacheNotFound", _Never):
        return {}
    out: dict[str, CachedRepo] = {}
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        files: set[str] = set()
        snapshot = None
        for rev in repo.revisions:
            names = {str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files}
            if "main" in rev.refs or snapshot is None:
                snapshot = rev.snapshot_path
                files = names
        out[repo.repo_id] = CachedRepo(repo.repo_id, repo.size_on_disk, files, snapshot)
    return out


# ---- fetching -------------------------------------------------------------------------------------------------
GATED_ORGS = ("meta-llama/",)  # repos whose files need an accepted licence and a logged-in account


def _how_to_get(repo: str) -> str:
    first = f"accept its licence on {hub_endpoint()}/{repo} (a gated repo), then " if repo.startswith(GATED_ORGS) else ""
    return first + (
        f"get it on a connected machine with `huggingface-cli download {repo}` (or `hf download {repo}`) and "
        f"copy the cache folder ({hub_cache_dir()}) here"
        + (", or unset HF_HUB_OFFLINE to download it now" if offline_mode() else "")
    )


def gated_message(repo: str) -> str:
    """What to do about a gated repo (Meta's Llama, ...): the licence is accepted once on its Hub page, then this
    machine must be logged in (or HF_TOKEN set) with that account."""
    return (
        f"{repo} is gated: accept its licence on {hub_endpoint()}/{repo} (logged in on the Hub), then log this "
        "machine in with `hf auth login` (or `huggingface-cli login`), or set HF_TOKEN to a token of that account"
    )


def _why_offline() -> str:
    return "HF_HUB_OFFLINE is set" if offline_mode() else f"the Hub ({hub_endpoint()}) cannot be reached"


def _no_files_error(repo: str, want: str, names: list[str]) -> MedusaChatError:
    if want == "heads":
        return HeadsError(
            f"{repo} has no Medusa heads file (expected {' or '.join(HEADS_FILES)}, or an EAGLE draft's "
            f"config.json + model.safetensors / pytorch_model.bin; it has: "
            f"{', '.join(names[:8]) or 'no files'}{', ...' if len(names) > 8 else ''})"
        )
    if want == "config":
        return ModelNotFoundError(f"{repo} has no config.json: not a transformers model or heads repo")
    if want == "tokenizer":
        return ModelNotFoundError(f"{repo} has no tokenizer files")
    return ModelNotFoundError(
        f"{repo} has no transformers checkpoint (config.json plus model*.safetensors or pytorch_model*.bin)"
    )


def fetch(
    repo: str,
    want: str,
    *,
    revision: str | None = None,
    progress: Progress | None = None,
    bars: bool | None = None,
) -> Path:
    """Make the files of `repo` needed for `want` ("config", "heads", "model") local; return the snapshot folder.

    `bars`: Rich progress bars on stderr (default: when stderr is a terminal). `progress`: text lines.
    """
    revision = revision or "main"
    if bars is None:
        bars = sys.stderr.isatty()
    if offline_mode() or not hub_reachable():
        return _fetch_cached(repo, want, revision)
    return _fetch_online(repo, want, revision, progress, bars)


class _Never(Exception):
    """Stands in for an exception class the installed huggingface_hub does not have."""


def _fetch_cached(repo: str, want: str, revision: str) -> Path:
    """Offline path: the real huggingface_hub lookup with local_files_only, then a completeness check."""
    import huggingface_hub
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    # Newer huggingface_hub (2.x) only: a cached repo listing, and an error for half-downloaded snapshots.
    get_cached_repo_tree = getattr(huggingface_hub, "get_cached_repo_tree", None)
    incomplete_error = getattr(huggingface_hub.errors, "IncompleteSnapshotError", _Never)
    no_listing_error = getattr(huggingface_hub.errors, "CachedRepoTreeNotFoundError", _Never)

    cache = hub_cache_dir()
    try:
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except incomplete_error as err:
        folder = Path(err.snapshot_path) if getattr(err, "snapshot_path", None) else None
        if folder is None:
            raise OfflineError(
                f"{repo}: the cached copy is incomplete and {_why_offline()}; {_how_to_get(repo)}"
            ) from err
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as err:
        raise OfflineError(
            f"{repo} is not in the Hugging Face cache ({cache}) and {_why_offline()}; {_how_to_get(repo)}"
        ) from err

    # What the repo holds: the tree listing cached by an earlier snapshot download, else what is on disk.
    names = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink()}
    listing_known = False
    try:
        if get_cached_repo_tree is not None:
            names |= {f.path for f in get_cached_repo_tree(repo, revision=revision, cache_dir=cache)}
            listing_known = True
    except (no_listing_error, OSError, ValueError):
        pass  # no cached listing (hand-made or older cache): what is on disk is all we know
    wanted = select_files(names, want)
    if not wanted:
        if listing_known:
            raise _no_files_error(repo, want, sorted(names))
        # Without a listing, "not in the cache" and "not in the repo" look the same: say what is missing.
        needed = {
            "model": "config.json and model weights (model*.safetensors or pytorch_model*.bin)",
            "heads": " or ".join(HEADS_FILES),
            "config": "config.json",
            "tokenizer": "tokenizer files",
        }[want]
        raise OfflineError(
            f"{repo}: the cached copy ({folder}) has no {needed} and {_why_offline()}; {_how_to_get(repo)}"
        )
    missing = [f for f in wanted if not (folder / f).is_file()]
    if want == "model" and not missing:
        missing = missing_shards(folder)
    if missing:
        raise OfflineError(
            f"{repo}: {len(missing)} needed file(s) are not in the Hugging Face cache "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}) and {_why_offline()}; "
            f"{_how_to_get(repo)}"
        )
    return folder


def _fetch_online(repo: str, want: str, revision: str, progress: Progress | None, bars: bool) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    try:
        info = HfApi(endpoint=hub_endpoint()).model_info(
            repo, revision=revision, files_metadata=True, timeout=15
        )
    except GatedRepoError as err:
        raise ModelNotFoundError(gated_message(repo)) from err
    except RepositoryNotFoundError as err:
        raise ModelNotFoundError(
            f"{repo} was not found on the Hub (check the name; private repos need `hf auth login`)"
        ) from err
    except RevisionNotFoundError as err:
        raise ModelNotFoundError(f"{repo} has no revision {revision!r}") from err
    except (HfHubHTTPError, OSError) as err:
        # The probe passed but the API failed (Hub outage, proxy): a complete cached copy still works.
        try:
            return _fetch_cached(repo, want, revision)
        except OfflineError:
            raise OfflineError(
                f"cannot list {repo} on the Hub ({type(err).__name__}) and it is not cached"
            ) from err

    sizes: dict[str, int | None] = {s.rfilename: s.size for s in info.siblings or []}
    wanted = select_files(sizes, want)
    if not wanted:
        raise _no_files_error(repo, want, sorted(sizes))

    def cached(name: str) -> str | None:
        hit = try_to_load_from_cache(repo, name, cache_dir=cache, revision=info.sha)
        return hit if isinstance(hit, str) else None

    todo = {f: sizes[f] for f in wanted if cached(f) is None}
    if todo:
        check_disk_space(cache, sum(s or 0 for s in todo.values()), repo)
        with DownloadReporter(repo, todo, progress, bars) as reporter:
            for name in todo:
                reporter.start_file(name)
                bar = {"tqdm_class": reporter.tqdm_class()} if _takes_tqdm_class(hf_hub_download) else {}
                try:
                    hf_hub_download(
                        repo,
                        name,
                        revision=revision,  # a branch name, so refs/<branch> is written for offline use later
                        cache_dir=cache,
                        endpoint=hub_endpoint(),
                        **bar,
                    )
                except GatedRepoError as err:  # the listing is public, the files are not (Llama's repos)
                    raise ModelNotFoundError(gated_message(repo)) from err
                except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
                    raise OfflineError(
                        f"download of {repo}/{name} failed ({type(err).__name__}: {str(err).splitlines()[0]}); "
                        "run the command again to resume it"
                    ) from err
    folder = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / info.sha
    if want == "model":
        # A sharded index may name shards the listing filter missed (unusual names): fetch those too.
        for shard in missing_shards(folder):
            hf_hub_download(repo, shard, revision=revision, cache_dir=cache, endpoint=hub_endpoint())
    if revision != info.sha:
        # hf_hub_download writes refs/<revision>; make sure it exists even when every file was cached already.
        ref = cache / ("models--" + repo.replace("/", "--")) / "refs" / revision
        if not ref.is_file() or ref.read_text().strip() != info.sha:
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(info.sha)
    return folder


def _takes_tqdm_class(func: Callable[..., object]) -> bool:
    import inspect

    return "tqdm_class" in inspect.signature(func).parameters


def check_disk_space(folder: Path, needed: int, repo: str) -> None:
    """Refuse a download that would (nearly) fill the disk, before any byte is written."""
    if needed <= 0:
        return
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed + DISK_MARGIN_BYTES:
        raise MedusaChatError(
            f"not enough disk space to download {repo}: it needs {human_bytes(needed)} but only "
            f"{human_bytes(free)} is free in {probe} (1 GB is kept in reserve); free some space or point "
            "HF_HUB_CACHE at a bigger disk"
        )
