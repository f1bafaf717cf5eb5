"""A folder of prompt files as a batch job: which files are prompts, where each answer goes,
and what a prompt file holds.

Every input `NAME` (`.txt`, `.md` plain text; `.json` chat messages) is answered in
`OUT/NAME.out`, keyed by the whole input name so that `a.txt` and `a.md` never share an answer.
"""

from __future__ import annotations

from pathlib import Path

from colibri.formats.safe_json import loads

PROMPT_SUFFIXES = (".txt", ".md", ".json")
OUTPUT_SUFFIX = ".out"


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the file."""


def check_folders(prompt_dir: Path, out_dir: Path | None) -> None:
    """Refuse a job whose answers would land among its prompts (a rerun would answer its answers)."""
    if out_dir is None:
        raise SystemExit("colibri run: error: --prompt-dir needs --out-dir")
    if not prompt_dir.is_dir():
        raise SystemExit(f"colibri run: error: --prompt-dir {prompt_dir}: no such folder")
    inside = out_dir.resolve()
    if inside == prompt_dir.resolve() or inside.is_relative_to(prompt_dir.resolve()):
        raise SystemExit(f"colibri run: error: --out-dir {out_dir} is inside --prompt-dir {prompt_dir}; "
                         "give a folder beside it")


def prompt_files(prompt_dir: Path) -> list[Path]:
    """The prompt files of the folder, in name order (links and other files are not prompts)."""
    return sorted(p for p in prompt_dir.iterdir()
                  if p.suffix in PROMPT_SUFFIXES and p.is_file() and not p.is_symlink())


def output_path(out_dir: Path, prompt: Path) -> Path:
    return out_dir / (prompt.name + OUTPUT_SUFFIX)


def read_prompt(path: Path, max_bytes: int):
    """A plain-text prompt (str) or chat messages (list of {"role", "content"} dicts)."""
    size = path.stat().st_size
    if size > max_bytes:
        raise PromptFileError(f"{path.name}: {size} bytes cannot fit the context (at most {max_bytes})")
    data = path.read_bytes()
    if path.suffix != ".json":
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{path.name}: not UTF-8 text (byte {e.start})") from None
    value = loads(data, path.name, PromptFileError)
    messages = value.get("messages") if isinstance(value, dict) else value
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f'{path.name}: expected {{"messages": [...]}} or a list of messages, a non-empty list')
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), (str, type(None)))):
            raise PromptFileError(f'{path.name}: message {i} is not {{"role": str, "content": str}}')
    return messages
