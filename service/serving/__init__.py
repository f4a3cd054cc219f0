"""The server, in layers whose imports run one way, down (``pyproject.toml``'s import-linter contracts keep it so).

A request's way down and the batch's way back::

    server · front · host · supervisor   process entries (one front; a front of several; the engine host; N fronts)
      api        the protocols' routes (/v1, /v2, KServe, gRPC), schemas, auth, HTTP/1.1 guards: validate, answer
      state      the composition root: what one process holds, built once
      client     the engine client, local or remote, chosen by one factory
      pipeline   limits, tokenize once, plan jobs, submit to backbone groups, render the answers
      remote     a front's side of the engine host: its link and the wire's messages
      models     the registry of models and heads; loading, control at runtime, the head cache
      engine     backbone groups: the batcher, the planner, the engine computing (torch), its processes
      observe    metrics, statistics, traces, logs
      core       plain values every layer passes: work, results, keys, errors, the lifecycle
"""
