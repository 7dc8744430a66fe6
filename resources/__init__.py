"""Where work runs: hardware catalog, pools, resource names, the affinity cost model, cluster
creation, worker-resident engines and registries, the reward client."""
