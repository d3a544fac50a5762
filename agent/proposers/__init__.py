"""Proposers: what writes a candidate change. Each has `name` and `run(session, toolbox) ->
Proposal` (raising `agent.session.RunStopped` or `BudgetExhausted` when it ends without one).

`claude` (the Messages API with tool use), `tuner` (successive halving over declared tunables on
measured time) and `replay` (re-runs a recorded trajectory's tool calls).
"""
