"""specserve's tooling, beside the engine (`app`) and its Serve deployments (`deployments`): the
`specserve` command (`specserve.cli`; `specserve.plan`, and `specserve.serving`, the served app's builder
for the built pairs), the benchmarks (`specserve.bench`), the GPU check (`specserve.gpu`), and the pairs
it builds and serves (`specserve.demo`). The engine never imports it."""
