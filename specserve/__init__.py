"""specserve's tooling, beside the engine (`app`) and its Serve deployments (`deployments`): the
`specserve` command (`specserve.cli`), the benchmarks, the GPU check, and the pairs it builds and
serves (`specserve.demo`). The engine never imports it."""
