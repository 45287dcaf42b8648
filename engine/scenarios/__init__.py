"""Runs to try, apart from the inference engine that runs them: named presets, workloads, scenario files
and the links that carry them.

- ``workloads``: requests with arrival steps, generated reproducibly from (name, seed);
- ``presets``: named scenarios (a workload plus the engine settings that make it interesting);
- ``run_spec``: ``RunSpec``, one run's settings and requests, the one place an ``EngineConfig`` is derived, and
  "paged, then the contiguous baseline" (``run_paged_then_contiguous``);
- ``scenario_file``: the validated JSON / YAML file format of a run, and its links;
- ``url_codec``: bytes packed into a URL query value and back (scenario links, lesson progress codes).
"""
