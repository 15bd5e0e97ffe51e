"""`pipeline deploy kubernetes`: rendered manifests and a kustomization for the build `pipeline build` plans.

plan (DeployOptions -> DeployPlan, pure), kubernetes (DeployPlan -> manifests, pure; and writing them)."""
