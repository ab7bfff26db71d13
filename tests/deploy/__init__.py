"""Offline checks of the deployment artefacts: Dockerfile, Helm chart, tooling script."""
