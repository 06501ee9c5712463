"""Write `trainaccel.init`'s keyword arguments and their docs from `Config`'s fields.

`init()` takes one typed keyword per option so that editors complete them and `help(trainaccel.init)` lists them;
Config stays the one place each option is defined. Run `python tools/init_signature.py` after changing an option;
tests/test_init_signature.py fails while the written part is out of date.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

PACKAGE_INIT = Path(__file__).resolve().parents[1] / "src" / "trainaccel" / "__init__.py"
BEGIN = "# --- init(): written by tools/init_signature.py from Config's fields; edit those, then run it. ---\n"
END = "# --- end of the written part ---\n"
WIDTH = 120

HEAD = '''\
    """Set trainaccel up in this worker: every DDP model built afterwards is accelerated. Returns the resolved config.

    An option left at None comes from its `trainaccel run` flag, else its `TRAINACCEL_<OPTION>` variable, else its
    default. A bad value or a misspelt keyword raises one line that names it. Idempotent; `shutdown()` undoes it.

    Args:
        start_process_group: start the default process group (env://) when the environment describes a distributed
            job and the script has not started one yet.
'''

TAIL = '''\
    """
    given = {name: value for name, value in locals().items() if value is not None and name != "misspelt"}
    from trainaccel.runtime import init as _init

    return _init(**given, **misspelt)


'''


def _shown(value: object) -> str:
    return "empty" if value is None else str(value)


def render() -> str:
    """The written part of src/trainaccel/__init__.py, markers included."""
    from trainaccel.config import Config

    params = ["    *,", "    start_process_group: bool = True,"]
    docs = [HEAD]
    for f in dataclasses.fields(Config):
        parse = f.metadata["parse"]
        params.append(f"    {f.name}: {parse.annotation} | None = None,")
        text = f"{f.name}: {f.metadata['help']}. Accepted: {parse.accepted}; default: {_shown(f.default)}."
        docs.append(textwrap.fill(text, WIDTH, initial_indent=" " * 8, subsequent_indent=" " * 12) + "\n")
    params.append("    **misspelt: NoReturn,")
    signature = "def init(\n" + "\n".join(params) + "\n) -> Config:\n"
    return BEGIN + signature + "".join(docs) + TAIL + END


def write(path: Path = PACKAGE_INIT) -> bool:
    """Replace the written part of `path`; True when it changed."""
    text = path.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render() + text[stop:]
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = write()
    print(f"{PACKAGE_INIT}: {'rewritten' if changed else 'already up to date'}", file=sys.stderr)
