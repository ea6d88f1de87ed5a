"""Several workers in one 2-rank launch, one after another: each runs as its own launch would run it (its argv:
its folder, then its arguments), and the registries it leaves open are closed after it. One process start and
one set of imports for all of them (conftest.launch_jobs). The process group stays up from the first job to the
last: a closed registry's ``shutdown`` is only a barrier here (a DeepSpeed engine built after the group was
destroyed and made again hung in DeepSpeed's ``new_group``).

argv: out_dir, a JSON object {job: [worker, args...]}; job's folder: out_dir/job.
"""

import json
import os
import runpy
import sys

import common
import multiengine.engines.registry as registry_module
from multiengine.engines import EngineRegistry, barrier

out, jobs = sys.argv[1], json.loads(sys.argv[2])
here = os.path.dirname(os.path.abspath(__file__))
finish = common.finish
common.finish = registry_module.shutdown = barrier  # the launch leaves the process group once, after the last job
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
