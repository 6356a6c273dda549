"""Why the bmv2 suite cannot run here, or None: one answer for every bmv2 test and benchmark."""

from __future__ import annotations

from pathlib import Path

from switchagg_lab.testbed.tools import missing_for_switch


def skip_reason() -> str | None:
    reason = missing_for_switch()
    if reason:
        return reason
    try:
        import switchagg_controller.switch_session  # noqa: F401
    except ImportError as e:
        return f"the controller's P4Runtime side (finsy) is not importable: {e}"
    try:
        import scapy  # noqa: F401
    except ImportError:
        return "bmv2 tests need scapy (pip install scapy)"
    from switchagg_controller import p4_program

    for path in (p4_program.BMV2_JSON, p4_program.P4INFO):
        if not Path(path).is_file():
            return f"compiled P4 program missing ({path}); run `make -C p4`"
    return None
