"""Stands in for the device's Python when ``launch/gpu_bench.sh`` is checked on a CPU.

``python tests/flags_only_python.py launch/<launcher>.py --flag=value ...`` loads the
launcher as a module (its flags get defined, its ``__main__`` block does not run) and
parses the command line as the launcher would (its ``parse_args(argv)`` for an argparse
launcher, else absl's flags), then exits: 0 when every flag is one the launcher defines
with a value it accepts, else 1 (absl) or 2 (argparse) with the parser's message.
``-c CODE`` (the script's version probe) is not run. A typo in the device script then
fails here, not in the 15 minutes a device is lent for.
"""

import importlib.util
import sys

from absl import flags


def main(argv: list[str]) -> int:
    if argv[:1] == ["-c"]:
        return 0
    path, *args = argv  # the launcher's own imports resolve as gpu_bench.sh sets PYTHONPATH
    spec = importlib.util.spec_from_file_location("launcher_under_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "parse_args"):  # argparse: exits 2 with its message on a bad flag
        module.parse_args(args)
        return 0
    normalize = getattr(module, "normalize_flag_spelling", lambda given: given)
    try:
        flags.FLAGS(normalize([path, *args]))
    except flags.Error as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
