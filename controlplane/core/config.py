"""Settings of the control plane: one pydantic-settings object, environment prefix MODELFLEET_CONTROLPLANE_
(the data plane's are MODELFLEET_, so MODELFLEET_PORT never means two things)."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Defaults that make `modelfleet controlplane` start on a laptop; refused outside development.
DEV_ADMIN_KEY = "mf-admin-development-only"
DEV_KEY_PEPPER = "modelfleet-development-pepper"
MIN_SECRET_LENGTH = 24


PREFIX = "MODELFLEET_CONTROLPLANE_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", populate_by_name=True)

    environment: Literal["development", "production"] = Field(
        default="development",
        description="production refuses the development admin key and pepper",
    )
    database_url: str = Field(
        default="sqlite:///.modelfleet/controlplane.db",
        validation_alias=AliasChoices(f"{PREFIX}DATABASE_URL", "DATABASE_URL", "database_url"),
        description="SQLAlchemy URL (SQLite or PostgreSQL); also read from DATABASE_URL, "
        "this name winning when both are set",
    )
    admin_key: SecretStr = Field(
        default=SecretStr(DEV_ADMIN_KEY), description="the admin's API key (Bearer token)"
    )
    key_pepper: SecretStr = Field(
        default=SecretStr(DEV_KEY_PEPPER), description="secret mixed into the stored hashes of tenant keys"
    )
    cluster: Literal["auto", "kubernetes", "none"] = Field(
        default="auto",
        description="auto: Kubernetes when a kubeconfig or an in-cluster service account is found, "
        "registry-only (none) otherwise",
    )
    kubeconfig: str | None = Field(
        default=None,
        validation_alias=AliasChoices(f"{PREFIX}KUBECONFIG", "KUBECONFIG"),
        description="kubeconfig file; also read from KUBECONFIG",
    )
    host: str = Field(default="127.0.0.1", description="address the API listens on")
    port: int = Field(default=8080, ge=1, le=65535, description="port the API listens on")
    db_pool_size: int = Field(default=10, ge=1, description="database connections kept open")
    db_connect_timeout_s: int = Field(default=5, ge=1, description="seconds to wait for a connection")
    migrate_on_start: bool = Field(
        default=True,
        description="bring the schema to head at start (one replica, development); false: never change "
        "the schema, wait until `modelfleet controlplane --migrate-only` (the chart's Job) has",
    )
    migrate_retry_s: float = Field(
        default=5.0,
        gt=0,
        description="until the schema is at head (database unreachable, or migrations not run yet), "
        "how often to try again",
    )
    key_sync_interval_s: float = Field(default=60.0, gt=0, description="how often expired keys leave Secrets")

    @field_validator("database_url")
    @classmethod
    def _psycopg_driver(cls, url: str) -> str:
        # psycopg 3 is the driver we ship; plain postgres URLs would make SQLAlchemy look for psycopg2.
        for plain in ("postgresql://", "postgres://"):
            if url.startswith(plain):
                return "postgresql+psycopg://" + url[len(plain) :]
        return url

    @model_validator(mode="after")
    def _no_default_secrets_outside_development(self) -> Settings:
        if self.environment == "development":
            return self
        for name, value, default in (
            (f"{PREFIX}ADMIN_KEY", self.admin_key, DEV_ADMIN_KEY),
            (f"{PREFIX}KEY_PEPPER", self.key_pepper, DEV_KEY_PEPPER),
        ):
            secret = value.get_secret_value()
            if secret == default or len(secret) < MIN_SECRET_LENGTH:
                raise ValueError(
                    f"{name}: set a random secret of at least {MIN_SECRET_LENGTH} characters "
                    f"when {PREFIX}ENVIRONMENT={self.environment}"
                )
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache
def get_settings() -> Settings:
    return Settings()
