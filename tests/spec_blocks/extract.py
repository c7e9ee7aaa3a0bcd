"""Extract every fenced block of the specs (../shared/spec/*.txt) into tests/spec_blocks/.

    python tests/spec_blocks/extract.py [--spec-dir DIR] [--write]

Each block is written verbatim (the lines between its fences) as its own file, named by spec file,
family, block index and kind: `004_lumina2_block07.config.json`. Without --write it only compares and
prints what differs (exit status 1 when anything does). With --write it rewrites the block files and
the generated fields of manifest.json (file, source, line, lang, kind, family), keeping the hand-kept
fields of each entry (combine, expect, refused_keys, xfail, note). tests/test_spec_configs.py asserts
that the fixtures still equal what this script extracts.

Kinds: config (a JSON object of config.json keys, or a fragment of one: key-value lines without the
braces), datasets (a JSON list: multidatabackend.json), prompts (a JSON object of name -> prompt: a
user prompt library), lycoris (a JSON object with "algo"), cli (a shell block holding a train command
line with --key value flags), other (any other shell block: install, login, mkdir, a bare train command;
listed in the manifest, not kept as a file).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_SPEC_DIR = ROOT.parent / "shared" / "spec"
MANIFEST = HERE / "manifest.json"

# spec files name their family in the prose; this table is the README's index of the specs
FAMILIES = {"000": "kandinsky5-image", "001": "kandinsky5-image", "002": "kandinsky5-video",
            "003": "kandinsky5-image", "004": "lumina2"}
GENERATED = ("id", "file", "source", "line", "lang", "kind", "family")
TESTED = ("config", "datasets", "prompts", "lycoris", "cli")  # kinds kept as fixture files
FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
TRAIN_COMMAND = re.compile(r"^\s*(?:simpletuner|difftune)\s+train\b|^\s*(?:\./)?train\.sh\b")


@dataclass(frozen=True)
class Block:
    source: str  # spec file name
    line: int  # 1-based line of the opening fence
    index: int  # 1-based index among the spec file's fenced blocks
    lang: str
    text: str  # the lines between the fences, verbatim, newline-terminated

    @property
    def family(self) -> str:
        return FAMILIES[self.source[:3]]

    @property
    def kind(self) -> str:
        return classify(self.lang, self.text)

    @property
    def id(self) -> str:
        return f"{self.source[:3]}_{self.family.replace('-', '_')}_block{self.index:02d}"

    @property
    def file(self) -> str | None:
        """The fixture's file name; None for the kind 'other' (listed in the manifest, not kept)."""
        if self.kind not in TESTED:
            return None
        ext = "json" if self.lang == "json" else "sh" if self.lang in ("bash", "sh", "shell") else "txt"
        return f"{self.id}.{self.kind}.{ext}"


def parse_json_block(text: str) -> object:
    """A block's JSON value; a fragment of key-value lines (no braces) is read as the object it belongs in."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads("{" + text.strip().rstrip(",") + "}")


def classify(lang: str, text: str) -> str:
    if lang in ("bash", "sh", "shell", ""):
        commands = [line for line in text.splitlines() if TRAIN_COMMAND.search(line)]
        return "cli" if any(re.search(r"\s--\w", line) for line in commands) else "other"
    if lang != "json":
        return "other"
    try:
        value = parse_json_block(text)
    except json.JSONDecodeError:
        return "other"
    if isinstance(value, list):
        return "datasets"
    if not isinstance(value, dict):
        return "other"
    if "algo" in value:
        return "lycoris"
    # A prompt library maps free names to prose; config keys are snake_case (or --snake_case).
    if value and all(isinstance(v, str) for v in value.values()) and not any("_" in k for k in value):
        return "prompts"
    return "config"


def extract(spec_dir: Path) -> list[Block]:
    blocks: list[Block] = []
    for path in sorted(spec_dir.glob("*.txt")):
        lines = path.read_text(encoding="utf-8").splitlines()
        opened: tuple[int, str] | None = None
        body: list[str] = []
        index = 0
        for number, line in enumerate(lines, start=1):
            m = FENCE.match(line)
            if opened is None:
                if m:
                    opened, body = (number, m.group(1).lower()), []
            elif m and not m.group(1):
                index += 1
                blocks.append(Block(path.name, opened[0], index, opened[1], "\n".join(body) + "\n"))
                opened = None
            else:
                body.append(line)
    return blocks


def manifest_entries(blocks: list[Block], old: list[dict]) -> list[dict]:
    by_id = {e["id"]: e for e in old}
    out = []
    for b in blocks:
        entry = {"id": b.id, "file": b.file, "source": b.source, "line": b.line, "lang": b.lang, "kind": b.kind,
                 "family": b.family}
        entry |= {k: v for k, v in by_id.get(b.id, {}).items() if k not in GENERATED}
        out.append(entry)
    return out


def differences(blocks: list[Block], folder: Path = HERE) -> list[str]:
    """What differs between the fixtures in `folder` and the blocks extracted from the specs."""
    problems = []
    expected = {b.file: b for b in blocks if b.file}
    present = {p.name for p in folder.iterdir() if re.match(r"\d{3}_.*_block\d\d\.", p.name)}
    for name in sorted(present - set(expected)):
        problems.append(f"{name}: a fixture no spec block gives any more")
    for name, block in expected.items():
        path = folder / name
        if not path.exists():
            problems.append(f"{name}: missing ({block.source} line {block.line})")
        elif path.read_text(encoding="utf-8") != block.text:
            problems.append(f"{name}: differs from {block.source} line {block.line}")
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    generated = [{k: e[k] for k in GENERATED} for e in manifest_entries(blocks, [])]
    recorded = [{k: e.get(k) for k in GENERATED} for e in manifest["blocks"]]
    if generated != recorded:
        problems.append("manifest.json: its file/source/line/lang/kind/family fields differ from the specs")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec-dir", type=Path, default=DEFAULT_SPEC_DIR)
    parser.add_argument("--write", action="store_true", help="rewrite the fixtures and the manifest's generated fields")
    args = parser.parse_args(argv)
    blocks = extract(args.spec_dir)
    if not args.write:
        problems = differences(blocks)
        print("\n".join(problems) or f"{len(blocks)} blocks, fixtures up to date")
        return 1 if problems else 0
    old = json.loads(MANIFEST.read_text(encoding="utf-8"))["blocks"] if MANIFEST.exists() else []
    for path in HERE.iterdir():
        if re.match(r"\d{3}_.*_block\d\d\.", path.name):
            path.unlink()
    for b in blocks:
        if b.file:
            (HERE / b.file).write_text(b.text, encoding="utf-8")
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8")) if MANIFEST.exists() else {}
    manifest["blocks"] = manifest_entries(blocks, old)
    MANIFEST.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(blocks)} blocks written to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
