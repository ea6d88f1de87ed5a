"""Several workers in one 2-rank launch, one after another: each runs as its own launch would run it (its argv:
its folder, then its arguments), and the registries it leaves open are closed after it. One process start and
one set of imports for all of them (conftest.launch_jobs). Each job leaves the process group as a worker does
(its registry's close() or its finish() destroys it) and the next job's registry makes a new one: close, then a
new registry in the same process, as any script may do it.

argv: out_dir, a JSON object {job: [worker, args...]}; job's folder: out_dir/job.
"""

import json
import os
import runpy
import sys

import common
from multiengine.engines import EngineRegistry
from multiengine.engines.dist import shutdown

out, jobs = sys.argv[1], json.loads(sys.argv[2])
here = os.path.dirname(os.path.abspath(__file__))
finish = common.finish
common.finish = shutdown  # a job's finish() leaves the process group without ending the launch
for job, (worker, *args) in jobs.items():
    folder = os.path.join(out, job)
    os.makedirs(folder, exist_ok=True)
    sys.argv = [os.path.join(here, f"{worker}.py"), folder, *args]
    scope = runpy.run_path(sys.argv[0], run_name="__main__")
    for value in scope.values():
        if isinstance(value, EngineRegistry):
            value.close()
sys.argv = [sys.argv[0], out]
common.dump({"jobs": list(jobs)})
finish()
