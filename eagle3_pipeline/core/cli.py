"""What every stage script shares: its parser (the docstring is the manual), logging, exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from eagle3_pipeline.core import layout
from eagle3_pipeline.core.config import add_config_flags, load_config_file, options_from_args, resolve_config
from eagle3_pipeline.core.errors import UserError

log = logging.getLogger("eagle3")

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

STAGES = layout.STAGES  # the stage order (its owner: layout.py); scripts/run_tiny.sh reads `... cli stages`
# What to run after each stage: the next script with the same --config, or with the flags that take this
# stage's output, from the layout's wiring (stage 06 ends the pipeline: its JSON and plot are the result).
NEXT_FLAGS = {section: layout.next_flags(section) for section in list(STAGES)[:-1]}
NEXT_STAGE = {
    section: (script, NEXT_FLAGS[section]) for section, script in zip(STAGES, list(STAGES.values())[1:])
}


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def setup_logging(level: str = "INFO") -> None:
    """One plain line per event on stderr; only rank 0 speaks in a distributed run."""
    handler = logging.StreamHandler(sys.stderr)
    prefix = "%(asctime)s %(levelname)s"
    if os.environ.get("WORLD_SIZE", "1") != "1":
        prefix += f" [rank {os.environ.get('RANK', '0')}]"
    handler.setFormatter(logging.Formatter(prefix + " %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level if is_rank0() else "WARNING")
    for noisy in ("httpx", "openai", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel("WARNING")


def build_parser(doc: str | None, cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, cls)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    return parser


def run_stage(
    doc: str | None,
    cls: type,
    argv: list[str] | None,
    body: Callable[[Any], int | None],
    extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
    plan: tuple[type, Callable[[Any, Any, str | None], int]] | None = None,
) -> int:
    """Parse, resolve the stage's config (`cls`, its [section]), run `body(cfg)`; a UserError is one line
    and exit status 2.

    A stage that sizes a run passes `plan = (PlanOptions, plan(cfg, options, config_path))`: `--plan` calls
    it instead.
    """
    section = cls.SECTION
    parser = build_parser(doc, cls)
    if extra_args is not None:
        extra_args(parser)
    if plan is not None:
        add_config_flags(parser.add_argument_group("plan (run nothing)"), plan[0], with_config=False)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = resolve_config(cls, args, section)
        options = options_from_args(plan[0], args) if plan is not None else None
        if plan is not None and options.plan:
            return int(plan[1](cfg, options, args.config) or 0)
        if extra_args is not None:
            cfg = (cfg, args)
        code = body(cfg)
        if not code and not getattr(args, "serve_line", False):  # a printed command is the whole output
            hint = next_step(section, cfg, args.config)
            if hint:
                log.info(hint)
    except UserError as e:
        log.error("error: %s", e)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    return int(code or 0)


def next_step(section: str, cfg: Any, config_path: str | None) -> str | None:
    """The command to run next after a successful stage, or None after the last one."""
    if section not in NEXT_STAGE:
        return None
    script, flags = NEXT_STAGE[section]
    out = getattr(cfg[0] if isinstance(cfg, tuple) else cfg, "out_dir", None)
    return f"next: python {script} " + (f"--config {config_path}" if config_path else flags.format(out=out))


def progress(iterable: Any = None, **kw: Any) -> Any:
    """tqdm that stays quiet when stderr is not a terminal or on ranks other than 0."""
    from tqdm import tqdm

    disable = not sys.stderr.isatty() or not is_rank0()
    return tqdm(iterable, disable=disable, dynamic_ncols=True, **kw)


def main(argv: list[str] | None = None) -> int:
    """For run scripts: `stages`, the stage scripts in order, one a line; `out-dir CONFIG SECTION`, the
    folder that stage writes under the config file (its own out_dir, else the layout's under [run] dir)."""
    parser = argparse.ArgumentParser(prog="python -m eagle3_pipeline.core.cli", description=main.__doc__)
    parser.add_argument("what", choices=["stages", "out-dir"])
    parser.add_argument("config", nargs="?", help="out-dir: the config file")
    parser.add_argument("section", nargs="?", choices=list(STAGES), help="out-dir: the stage's [section]")
    a = parser.parse_args(argv)
    if a.what == "stages":
        print("\n".join(STAGES.values()))
        return 0
    if a.config is None or a.section is None:
        parser.error("out-dir needs CONFIG and SECTION")
    try:
        out = load_config_file(a.config, a.section).get("out_dir")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if out is None:
        print(f"error: {a.config}: [{a.section}] has no out_dir and the file no [run] dir", file=sys.stderr)
        return EXIT_USER_ERROR
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
