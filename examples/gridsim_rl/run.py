"""The gridsim RL example, one command from nothing to a trained policy and its report:

    python examples/gridsim_rl/run.py [--settings FILE] [--device cpu|cuda] [--out DIR]
                                      [--smoke] [--stage STAGE ...] [--set KEY=VALUE ...]

Stages, in order (``--stage`` picks some; by default all), each skipped when its output exists,
so a run that stopped resumes where it stopped:

1. ``data`` (``DIR/data``): the bundle served by corral's env server and its rows written by
   corral's row writer (``DIR/rows``); synthetic days checked disjoint from the eval days; one
   chat transcript per warm-start day (the teacher's submission: the greedy rule's schedule,
   with a random feasible edit of one or two hours on ``days.edit_share`` of the days, checked
   through the env and verifier): ``train.jsonl``, ``eval.jsonl`` (held-out synthetic days),
   ``summary.json``.
2. ``model`` (``DIR/base_model``): a BPE tokenizer trained on the transcripts' text with a
   ChatML tool-calling template (corral's Qwen 2.5 one, or it without the system turn), and a
   random Qwen3 model, saved in bfloat16; ``build.json``.
3. ``sft`` (``DIR/sft/phase-N``): corral's SFT run once per ``[[sft.phases]]`` entry, each from
   the previous phase's model; a phase cut short resumes from its last checkpoint. The last
   phase's ``model`` folder is the RL start.
4. ``rl`` (``DIR/rl``): corral's RL loop (env server, local engine + gateway, rollouts, group
   filter, megatron-core GRPO update, in-memory weight push, evals at temperature 0 before the
   first step and every ``eval_every`` steps), resuming from its latest checkpoint. Done when its
   checkpoint and evaluation of the last step exist (raise ``rl.schedule.steps`` to go on).
5. ``report`` (``DIR/report``, always rewritten): ``results.json``, ``results.md``,
   ``curves.png``, ``reward.png`` and ``final_model`` (the last checkpoint in bfloat16).

Exit status 0 when every chosen stage is done; 1 with a message when one fails; 2 for bad
settings or arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):  # run as a script: make this folder the package gridsim_rl
    sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]
    __package__ = "gridsim_rl"

from rich.console import Console  # noqa: E402

from .settings import DEFAULT_SETTINGS, ROOT, Settings, SettingsError, load_settings  # noqa: E402

STAGES = ("data", "model", "sft", "rl", "report")


class StageError(RuntimeError):
    """A stage cannot run (its input is missing) or failed; the message says which and why."""


class Pipeline:
    """The stages of one output folder ``out`` under ``settings`` (module docstring)."""

    def __init__(self, settings: Settings, out: Path, console: Console | None = None) -> None:
        self.settings = settings
        self.out = out
        self.console = console or Console()
        self.rows_dir = out / "rows"
        self.data_dir = out / "data"
        self.base_model = out / "base_model"
        self.sft_dir = out / "sft"
        self.rl_dir = out / "rl"
        self.report_dir = out / "report"

    # -- paths and done-markers ---------------------------------------------------------------

    @property
    def sft_model(self) -> Path:
        return self.sft_dir / f"phase-{len(self.settings.sft_phases())}" / "model"

    def done(self, stage: str) -> bool:
        """Whether ``stage``'s output exists (the report is always rewritten)."""
        if stage == "data":
            summary = self.data_dir / "summary.json"
            if not summary.is_file():
                return False
            # Data written with other edits would be reused silently by every later stage.
            written = json.loads(summary.read_text()).get("edit_share", 0.0)
            if written != self.settings.days.edit_share:
                raise StageError(
                    f"{self.data_dir} was written with days.edit_share={written}, the settings "
                    f"say {self.settings.days.edit_share}: use another --out"
                )
            return True
        if stage == "model":
            return (self.base_model / "build.json").is_file()
        if stage == "sft":
            return (self.sft_model / "config.json").is_file()
        if stage == "rl":
            return self._rl_done()
        return False

    def _rl_done(self) -> bool:
        steps = int(self.settings.rl.get("schedule", {}).get("steps", 10))
        reached = self._rl_reached()
        return reached is not None and reached >= steps

    def _rl_reached(self) -> int | None:
        """The step of the RL run's latest checkpoint when it was also evaluated (a run's end,
        or its stop at ``schedule.time_limit``); 0 for a finished run of no steps; else None."""
        from corral.trainer.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.rl_dir)
        reached = 0 if latest is None else json.loads((latest / "state.json").read_text())["step"]
        evaluated = (self.rl_dir / "evals" / f"step-{reached:06d}").is_dir()
        return reached if evaluated else None

    def run(self, stages: tuple[str, ...] = STAGES) -> None:
        """Run ``stages`` in order, skipping those already done (the report is always run)."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "settings.json").write_text(self.settings.model_dump_json(indent=2) + "\n")
        if self.settings.allow_tf32 and self.settings.device == "cuda":
            import torch

            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        for stage in STAGES:
            if stage not in stages:
                continue
            if self.done(stage):
                self.console.print(f"[green]{stage}[/]: done already, skipped")
                continue
            self.console.rule(f"[bold]{stage}")
            began = time.monotonic()
            getattr(self, f"stage_{stage}")()
            seconds = time.monotonic() - began
            self._record_time(stage, seconds)
            self.console.print(f"[green]{stage}[/]: done in {seconds:.1f} s")

    def _record_time(self, stage: str, seconds: float) -> None:
        path = self.out / "times.json"
        times = json.loads(path.read_text()) if path.is_file() else {}
        times[stage] = round(times.get(stage, 0.0) + seconds, 1)
        path.write_text(json.dumps(times, indent=2) + "\n")

    # -- stages -------------------------------------------------------------------------------

    def stage_data(self) -> None:
        """Rows from the served bundle, synthetic days, checked transcripts (module docstring)."""
        from .days import check_disjoint, check_rows, gridsim, serve_rows, synthetic_tasks
        from .transcripts import write_transcripts

        days = self.settings.days
        max_turns = int(self.settings.rl.get("env", {}).get("max_turns", 4))
        rows = serve_rows(self.rows_dir, max_turns)
        tools = check_rows(rows)
        self.console.print(
            f"{len(rows)} rows from corral's env server match the tasks as rendered; "
            f"tools {[t['function']['name'] for t in tools]}"
        )
        evals = gridsim().tasks("eval")
        synthetic = synthetic_tasks(days)
        check_disjoint(synthetic, evals)
        check_disjoint(gridsim().tasks("train"), evals)
        if days.held_out >= max(len(synthetic), 1):
            raise StageError(f"days.held_out={days.held_out} leaves no synthetic day to train on")
        cut = len(synthetic) - days.held_out
        train = [*gridsim().tasks("train")[: days.train_days], *synthetic[:cut]]
        held_out = synthetic[cut:]
        self.data_dir.mkdir(parents=True, exist_ok=True)

        def write(name: str, tasks: list[Any]) -> dict[str, Any]:
            return write_transcripts(self.data_dir / name, tasks, tools, days.edit_share, days.seed)

        train_stats = write("train.jsonl", train)
        eval_stats = write("eval.jsonl", held_out) if held_out else None
        summary = {
            "train_days": days.train_days,
            "synthetic_days": len(synthetic),
            "synthetic_dates": [synthetic[-1].data["date"], synthetic[0].data["date"]]
            if synthetic
            else None,
            "synthetic_seed": days.seed,
            "edit_share": days.edit_share,
            "held_out_days": len(held_out),
            "train": train_stats,
            "eval": eval_stats,
            "eval_days_checked_disjoint": len(evals),
        }
        (self.data_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.console.print(
            f"{train_stats['conversations']} training transcripts ({days.train_days} train days, "
            f"{cut} synthetic), {len(held_out)} held out; mean grade "
            f"{train_stats['mean_grade']:.3f} (the greedy rule's "
            f"{train_stats['greedy_mean_grade']:.3f}); {train_stats['edited']} edited, "
            f"{train_stats['edited_better']} of them better than the rule"
        )

    def stage_model(self) -> None:
        """The tokenizer (trained on the transcripts' text) and the random model."""
        from .build import build_model, corpus, train_tokenizer
        from .transcripts import token_stats

        self._need("data")
        lines = []
        with (self.data_dir / "train.jsonl").open() as f:
            for n, line in enumerate(f):
                if n >= self.settings.tokenizer.corpus_days:
                    break
                lines.append(json.loads(line))
        tokenizer = train_tokenizer(
            corpus(lines, self.settings.tokenizer.template), self.settings.tokenizer
        )
        scratch = self.base_model.with_name(self.base_model.name + ".partial")
        info = build_model(scratch, tokenizer, self.settings.model)
        stats = token_stats(self.data_dir / "train.jsonl", tokenizer, limit=300)
        held = self.data_dir / "eval.jsonl"
        if held.is_file() and held.stat().st_size:
            stats["longest"] = max(stats["longest"], token_stats(held, tokenizer)["longest"])
        prompt = lines[0]["messages"][1]["content"]
        stats["user_prompt_tokens_per_char"] = len(tokenizer(prompt)["input_ids"]) / len(prompt)
        limit = self.settings.model.max_position_embeddings
        if stats["longest"] > limit // 2:
            raise StageError(
                f"the longest transcript has {stats['longest']} tokens: more than half of "
                f"max_position_embeddings={limit} (multi-turn rollouts need the room)"
            )
        info["tokens"] = stats
        _check_saved_tokenizer(scratch, tokenizer, lines[0])
        (scratch / "build.json").write_text(json.dumps(info, indent=2) + "\n")
        if self.base_model.exists():
            import shutil

            shutil.rmtree(self.base_model)
        scratch.rename(self.base_model)
        self.console.print(
            f"model: {info['parameters']:,} parameters, {info['safetensors_bytes'] / 1e6:.1f} MB "
            f"(bf16), vocab {info['vocab_size']}; transcripts {stats['mean_tokens']:.0f} tokens "
            f"(reply {stats['mean_reply_tokens']:.0f}), longest {stats['longest']}; user prompt "
            f"{stats['user_prompt_tokens_per_char']:.2f} tokens per character"
        )

    def stage_sft(self) -> None:
        """The SFT phases, each resuming or skipped on its own."""
        from rich.progress import Progress

        from corral.trainer.sft_run import run_sft

        self._need("model")
        start = self.base_model
        held = self.data_dir / "eval.jsonl"
        eval_data = held if held.is_file() and held.stat().st_size else None
        phases = self.settings.sft_phases()
        for number, phase in enumerate(phases, start=1):
            run_dir = self.sft_dir / f"phase-{number}"
            if (run_dir / "model" / "config.json").is_file():
                self.console.print(f"SFT phase {number}: done already")
                start = run_dir / "model"
                continue
            config = self.settings.sft_config(
                phase, data=self.data_dir / "train.jsonl", eval_data=eval_data, run_dir=run_dir,
                model=start,
            )  # fmt: skip
            self.console.print(
                f"SFT phase {number}/{len(phases)}: {phase.epochs:g} epochs at lr {phase.lr:g}"
            )
            with Progress(console=self.console, transient=True) as progress:
                bar = progress.add_task(f"phase {number}", total=None)

                def on_line(
                    line: dict[str, Any],
                    bar: Any = bar,
                    progress: Any = progress,
                    number: int = number,
                ) -> None:
                    if line.get("kind") == "eval":
                        self.console.print(
                            f"  step {line['step']:>5} eval loss {line['eval/loss']:.4f} "
                            f"accuracy {line['eval/accuracy']:.4f}"
                        )
                    else:
                        progress.update(
                            bar,
                            completed=line["step"],
                            description=f"phase {number} loss {line['loss']:.4f} "
                            f"acc {line['accuracy']:.3f}",
                        )

                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)")
                    lines = run_sft(config, on_line=on_line)
            last = [line for line in lines if line.get("kind") != "eval"]
            if last:
                self.console.print(
                    f"  phase {number}: {last[-1]['step']} steps, loss {last[-1]['loss']:.4f}, "
                    f"accuracy {last[-1]['accuracy']:.4f}"
                )
            start = run_dir / "model"

    def stage_rl(self) -> None:
        """corral's RL loop from the SFT model (resumes from its checkpoint)."""
        from corral.trainer.launch import run_training

        self._need("sft")
        config = self.settings.train_config(run_dir=self.rl_dir, model=self.sft_model)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)")
            run_training(config, self.console)

    def stage_report(self) -> None:
        """Results, curves and the final model (always rewritten)."""
        from .report import export_final_model, render_table, write_report

        if self._rl_reached() is None:
            raise StageError(f"no evaluated RL checkpoint in {self.rl_dir}: run stage 'rl' first")
        final = export_final_model(self.rl_dir, self.sft_model, self.report_dir / "final_model")
        facts: dict[str, Any] = {}
        summary = json.loads((self.data_dir / "summary.json").read_text())
        build = json.loads((self.base_model / "build.json").read_text())
        facts["warm-start days"] = (
            f"{summary['train_days']} train days + {summary['synthetic_days']} synthetic days "
            f"({summary['held_out_days']} of them held out), dates "
            f"{summary['synthetic_dates']}, seed {summary['synthetic_seed']}"
        )
        train = summary["train"]
        facts["grade of the SFT data"] = round(train["mean_grade"], 4)
        if "edited" in train:  # data folders from before the teacher's edits lack these
            facts["greedy grade on the SFT days"] = round(train["greedy_mean_grade"], 4)
            facts["edited SFT days"] = (
                f"{train['edited']} of {train['conversations']} (edit_share "
                f"{summary['edit_share']}): {train['edited_better']} beat the rule, "
                f"{train['edited_graded_0']} grade 0"
            )
        facts["model"] = (
            f"Qwen3 {build['model']['num_hidden_layers']} layers x {build['model']['hidden_size']}"
            f", {build['parameters']:,} parameters, vocab {build['vocab_size']}"
        )
        facts["final model"] = (
            f"{final} ({sum(p.stat().st_size for p in final.glob('*.safetensors')) / 1e6:.1f} MB)"
        )
        facts["device"] = self.settings.device
        times = self.out / "times.json"
        if times.is_file():
            facts["stage seconds"] = json.loads(times.read_text())
        results = write_report(self.report_dir, self.rl_dir, facts)
        self.console.print(render_table(results["policies"]))
        self.console.print(f"report in {self.report_dir}")

    def _need(self, stage: str) -> None:
        if not self.done(stage):
            raise StageError(f"stage {stage!r} has not run in {self.out}: run it first")


def _check_saved_tokenizer(folder: Path, built: Any, transcript: dict[str, Any]) -> None:
    """StageError unless ``AutoTokenizer`` (what the gateway, engine and trainer load) encodes a
    rendered transcript exactly as the tokenizer just trained. transformers swaps in its own
    pre-tokenizer for some model types (Qwen2's splits digits one by one); Qwen3 keeps ours."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(folder))
    text = built.apply_chat_template(
        transcript["messages"], tools=transcript["tools"], tokenize=False
    )
    if loaded(text)["input_ids"] != built(text)["input_ids"]:
        raise StageError(
            f"AutoTokenizer loads {type(loaded).__name__} from {folder}, which tokenizes "
            "differently from the trained tokenizer"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="gridsim RL from scratch: data, model, SFT, GRPO, report."
    )
    parser.add_argument("--settings", type=Path, default=DEFAULT_SETTINGS)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="overrides the settings")
    parser.add_argument("--out", type=Path, help="the output folder (default runs/gridsim_rl)")
    parser.add_argument("--smoke", action="store_true", help="apply the [smoke] settings")
    parser.add_argument("--stage", action="append", choices=STAGES, help="run only these")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a setting, e.g. --set rl.schedule.steps=40 (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.device:
        overrides.append(f'device="{args.device}"')
    console = Console()
    try:
        settings = load_settings(args.settings, smoke=args.smoke, overrides=overrides)
    except SettingsError as exc:
        console.print(f"[red]settings: {exc}")
        return 2
    default_out = ROOT / "runs" / ("gridsim_rl_smoke" if args.smoke else "gridsim_rl")
    pipeline = Pipeline(settings, (args.out or default_out).resolve(), console)
    try:
        pipeline.run(tuple(args.stage) if args.stage else STAGES)
    except (StageError, ValueError, OSError) as exc:
        console.print(f"[red]{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
