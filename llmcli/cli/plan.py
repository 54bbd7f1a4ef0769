"""`llmcli plan`: before training, what a config needs (memory, FLOPs) and how long it takes."""

from __future__ import annotations

import typer

from llmcli.cli.app import app, log_to_stderr, notify
from llmcli.cli.options import ConfigArg, ConfigDeviceOption, JsonOption, SetOption


@app.command("plan")
def plan_command(
    config: ConfigArg,
    set_: SetOption = None,
    device: ConfigDeviceOption = None,
    json_: JsonOption = False,
) -> None:
    """Before training: parameters, FLOPs per token, memory per step and whether it fits, the
    step time of a few warm steps and the time to train.max_steps."""
    import json

    from llmcli.config import load_config
    from llmcli.training.plan import format_plan, make_plan

    log_to_stderr()
    plan = make_plan(load_config(config, set_ or []), device)
    if not json_:
        typer.echo(format_plan(plan))
        return
    typer.echo(json.dumps(plan.to_json(), indent=2))
    if plan.missing:
        notify(f"missing: {plan.missing}")
