"""``python -m bench NAME [ARGS]``: run one benchmark (from the repository's root, in the
quantize environment); ``python -m bench`` lists them."""

from __future__ import annotations

import argparse
import importlib
import sys

from bench import experiments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = experiments()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.splitlines()[0].strip("`") + "\n")
        for name in names:
            print(f"  {name:<18} {summary(name)}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"python -m bench: no benchmark {name!r}; choose of {', '.join(names)}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}")
    parser = parser_of(name, module)
    args = parser.parse_args(rest)
    args.argv = rest
    return module.run(args)


def summary(name: str) -> str:
    """A benchmark's first docstring line (read without importing it: imports are slow)."""
    import ast
    from pathlib import Path

    source = (Path(__file__).parent / f"{name}.py").read_text()
    return (ast.get_docstring(ast.parse(source)) or "").splitlines()[0]


def parser_of(name: str, module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m bench {name}",
                                     description=module.__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_args(parser)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
