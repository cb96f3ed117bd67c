"""What ``ampkit doctor SCRIPT`` found: the script report, and the merge of process-level findings
with the op-level findings of replays."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ampkit.diagnose.core.display import sort_findings
from ampkit.diagnose.script.ending import SIGNAL_EXIT_STATUS
from ampkit.diagnose.script.where import where_sentence
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding

__all__ = ["ScriptReport", "merge_replayed_findings"]


@dataclass
class ScriptReport:
    """What ``run_script`` observed; ``report.json.doctor_document(report)`` is its ``ampkit.doctor/1`` document."""

    script: str
    argv: list[str]
    findings: list[Finding]
    """Process-level and op-level findings, merged, worst first."""
    diagnoses: list[DiagnosisResult] = field(default_factory=list)
    """The op-level replays (failures first, then the checkup)."""
    exit_status: int = 0
    """The script's own exit status (1 for an uncaught exception)."""
    steps: int = 0
    """Optimizer steps observed (skipped ones included)."""
    replays: list[dict[str, Any]] = field(default_factory=list)
    device: str | None = None
    """The device the observed models ran on."""
    scalers: list[dict[str, Any]] = field(default_factory=list)
    """Per enabled GradScaler: where it was created, its scale trajectory summary, skipped steps."""
    ended: str | None = None
    """How a partial run ended (``script.ending.ENDINGS``); None for a normal end, ``sys.exit`` included."""
    tasks: list[str] = field(default_factory=list)
    """Names of the Task instances and classes the script defines (a file meant for ``FILE:attr``)."""
    mixed_precision: dict[str, Any] = field(default_factory=dict)
    """Mixed precision asked for versus what ran (``script.mixed.mixed_precision_record``)."""
    compiled: list[dict[str, Any]] = field(default_factory=list)
    """The script's ``torch.compile`` calls (``watchers.compile.CompileCall``); the run was eager."""
    compiled_comparison: dict[str, Any] | None = None
    """``--compare-compiled``: the module-by-module comparison (``step.compiled.CompiledComparison``)."""
    checkup: dict[str, Any] = field(default_factory=dict)
    """Whether the end-of-run fp32 checkup ran, on which step, else why not (``script.checkup``)."""
    forked_child: bool = False
    """This process is a child the script forked (``watchers.fork``): the report of the run is the parent's,
    so ``ampkit doctor`` neither prints nor writes this one."""

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    @property
    def partial(self) -> bool:
        """The script did not reach its normal end: the findings are those made until then."""
        return self.ended is not None

    def doctor_exit_status(self) -> int:
        """``ampkit doctor``'s exit status: 130/143/129 after SIGINT/SIGTERM/SIGHUP, else the script's own non-zero
        status, else 1 for an error-severity finding, else 0."""
        if self.ended in SIGNAL_EXIT_STATUS:
            return SIGNAL_EXIT_STATUS[self.ended]
        if self.exit_status:
            return self.exit_status
        return 1 if self.has_errors else 0

    def environment(self) -> dict[str, Any]:
        from ampkit.env import collect_environment

        env = collect_environment(self.device)
        env.update({"script": self.script, "argv": self.argv, "exit_status": self.exit_status, "steps": self.steps,
                    "replays": self.replays, "scalers": self.scalers})
        return env

    def result(self) -> DiagnosisResult:
        """One ``DiagnosisResult`` for the HTML page and the JSON document: merged findings, the first replay's
        headroom, comparison and bisection."""
        first = self.diagnoses[0] if self.diagnoses else None
        if first is None:
            return DiagnosisResult(findings=self.findings, environment=self.environment())
        return dataclasses.replace(first, findings=self.findings, environment=self.environment())


def merge_replayed_findings(process: list[Finding], replayed: list[Finding]) -> list[Finding]:
    """Process-level findings plus op-level ones; one finding per code and module.

    An op-level finding supersedes a process-level one of the same code when their modules
    agree or one of them names none: it keeps the op and module, takes the process finding's
    location if it has none, and merges the evidence.
    """
    out = list(process)
    for f in replayed:
        twin = next((i for i, p in enumerate(out) if p.code == f.code
                     and (p.module is None or f.module is None or p.module == f.module)), None)
        if twin is None:
            if not any(p.code == f.code and p.module == f.module and p.op == f.op for p in out):
                out.append(f)
            continue
        p = out[twin]
        if p.op is not None and f.op is None:
            continue  # already op-level
        out[twin] = dataclasses.replace(  # an explained exception's place in training stays in the message
            f, location=f.location or p.location, module=f.module or p.module, message=f.message + (
                where_sentence(p.evidence) if "where" not in f.evidence else ""),
            evidence={**p.evidence, **f.evidence}, step=f.step if f.step is not None else p.step,
        )
    return sort_findings(out)
