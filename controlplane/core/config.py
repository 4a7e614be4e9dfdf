"""Settings of the control plane: one pydantic-settings object, environment prefix MODELFLEET_."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Defaults that make `modelfleet controlplane` start on a laptop; refused outside development.
DEV_ADMIN_KEY = "mf-admin-development-only"
DEV_KEY_PEPPER = "modelfleet-development-pepper"
MIN_SECRET_LENGTH = 24


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MODELFLEET_", extra="ignore", populate_by_name=True)

    environment: Literal["development", "production"] = "development"
    # Also read from the conventional DATABASE_URL; the prefixed name wins when both are set.
    database_url: str = Field(
        default="sqlite:///.modelfleet/controlplane.db",
        validation_alias=AliasChoices("MODELFLEET_DATABASE_URL", "DATABASE_URL", "database_url"),
    )
    admin_key: SecretStr = SecretStr(DEV_ADMIN_KEY)
    key_pepper: SecretStr = SecretStr(DEV_KEY_PEPPER)
    # auto: Kubernetes when a kubeconfig or an in-cluster service account is found, registry-only otherwise.
    cluster: Literal["auto", "kubernetes", "none"] = "auto"
    kubeconfig: str | None = Field(
        default=None, validation_alias=AliasChoices("MODELFLEET_KUBECONFIG", "KUBECONFIG")
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    db_pool_size: int = Field(default=10, ge=1)
    db_connect_timeout_s: int = Field(default=5, ge=1)
    migrate_retry_s: float = Field(default=5.0, gt=0)
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
            ("MODELFLEET_ADMIN_KEY", self.admin_key, DEV_ADMIN_KEY),
            ("MODELFLEET_KEY_PEPPER", self.key_pepper, DEV_KEY_PEPPER),
        ):
            secret = value.get_secret_value()
            if secret == default or len(secret) < MIN_SECRET_LENGTH:
                raise ValueError(
                    f"{name}: set a random secret of at least {MIN_SECRET_LENGTH} characters "
                    f"when MODELFLEET_ENVIRONMENT={self.environment}"
                )
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache
def get_settings() -> Settings:
    return Settings()
