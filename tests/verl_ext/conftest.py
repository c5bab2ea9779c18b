"""verl tests need a verl environment (``.ci/verl_env.sh 0.9.1``); elsewhere each module skips."""

import importlib.util


def pytest_report_header(config):
    if importlib.util.find_spec("verl") is None:
        return "verl: not installed (tests/verl_ext skip; build an environment with .ci/verl_env.sh)"
    from importlib.metadata import version
    return f"verl: {version('verl')}"
