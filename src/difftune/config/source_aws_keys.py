"""Dataset-entry keys of type 'aws': an S3 bucket (or any S3-compatible store). data/sources/s3.py downloads it into
instance_data_dir before discovery.

SimpleTuner's keys (its DATALOADER page and S3 backend): `aws_bucket_name`, `aws_data_prefix`, `aws_endpoint_url`,
`aws_region_name`, `aws_access_key_id`, `aws_secret_access_key`, `aws_session_token`, `aws_max_pool_connections`.
Where difftune differs, the key's description says so: SimpleTuner reads each object from the bucket while it trains
and requires all of bucket, region, endpoint and both keys; here only the bucket is required (the rest comes from
boto3's usual places: AWS_* environment variables, ~/.aws, an instance role), and the objects are downloaded once.
A null or empty value of any of these keys means "not set" (SimpleTuner's example writes `"aws_region_name": null`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator, model_validator

from difftune.config.fields import field

AWS_KEYS = ("aws_bucket_name", "aws_data_prefix", "aws_endpoint_url", "aws_region_name", "aws_access_key_id",
            "aws_secret_access_key", "aws_session_token", "aws_max_pool_connections")
# Keys whose values must never be shown (messages print "set" or a masked form instead).
AWS_SECRET_KEYS = ("aws_secret_access_key", "aws_session_token")
AWS_DEFAULT_POOL = 128  # SimpleTuner's default of aws_max_pool_connections
_TEXT_KEYS = ("aws_bucket_name", "aws_data_prefix", "aws_endpoint_url", "aws_region_name", "aws_access_key_id",
              "aws_secret_access_key", "aws_session_token")


def aws_value_set(value: Any) -> bool:
    return value is not None and value != ""


class AwsSource(BaseModel):
    """The keys of a type 'aws' dataset entry (a mixin of ImageDataset). All are advanced, as the csv and
    huggingface keys are: a local entry, the usual one, has no use for them (forms list basic keys first)."""

    aws_bucket_name: str | None = field(
        None, "Type 'aws': the name of the S3 bucket holding the images (or clips), without s3:// (the place inside "
        "it is aws_data_prefix). Required for type 'aws'.", "data", advanced=True,
    )
    aws_data_prefix: str = field(
        "", "Type 'aws': where the images are inside the bucket, as a key prefix such as 'photos/cats' (empty: the "
        "whole bucket). It is read as a folder ('photos/cats' and 'photos/cats/' are the same). Every image (or "
        "clip) under it is downloaded into instance_data_dir with its key below the prefix as its name, sub-folders "
        "kept; with caption_strategy 'textfile', the .txt of the same name beside each image comes too.", "data",
        advanced=True,
    )
    aws_endpoint_url: str | None = field(
        None, "Type 'aws': the address of an S3-compatible store (MinIO, Cloudflare R2, Backblaze B2, ...), an "
        "http(s) URL. Empty: AWS S3 itself (or AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL when set).", "data",
        advanced=True,
    )
    aws_region_name: str | None = field(
        None, "Type 'aws': the bucket's region (with an S3-compatible store, the region it signs for, e.g. 'auto' "
        "for R2). Empty: AWS_DEFAULT_REGION or ~/.aws/config. Unlike SimpleTuner, which drops it when "
        "aws_endpoint_url is set, it is passed with the endpoint too.", "data", advanced=True,
    )
    aws_access_key_id: str | None = field(
        None, "Type 'aws': the access key id, with aws_secret_access_key. Empty: boto3 finds the credentials "
        "itself (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws/credentials, an instance "
        "role), which keeps them out of the config; SimpleTuner requires them here.", "data", advanced=True,
    )
    aws_secret_access_key: str | None = field(
        None, "Type 'aws': the secret access key, with aws_access_key_id (never printed: messages mask it).",
        "data", advanced=True,
    )
    aws_session_token: str | None = field(
        None, "Type 'aws': a session token for temporary credentials, with aws_access_key_id and "
        "aws_secret_access_key (never printed).", "data", advanced=True,
    )
    aws_max_pool_connections: int | None = field(
        None, "Type 'aws': at most this many connections to the store at once (botocore's connection pool, as in "
        "SimpleTuner); the download runs on min(this, 8) threads. Empty: the config's aws_max_pool_connections, "
        f"else {AWS_DEFAULT_POOL}.", "data", ge=1, advanced=True,
    )

    @field_validator(*_TEXT_KEYS, mode="before")
    @classmethod
    def _aws_text(cls, value: Any, info: Any) -> Any:
        """A value of another type is refused here, with a message that does not repeat it (it may be a secret)."""
        if value is not None and not isinstance(value, str):
            raise ValueError(f"must be a string (got a {type(value).__name__})")
        return value

    @model_validator(mode="after")
    def _aws_keys(self) -> Any:
        kind = getattr(self, "type", "local")
        given = [k for k in AWS_KEYS if aws_value_set(getattr(self, k))]
        if kind != "aws":
            if given:
                one = len(given) == 1
                raise ValueError(f"{', '.join(given)} belong{'s' if one else ''} to datasets of type 'aws'; this "
                                 f"one is type {kind!r}: remove {'it' if one else 'them'} or set type to 'aws'")
            return self
        bucket = self.aws_bucket_name
        if not bucket:
            raise ValueError("type 'aws' needs aws_bucket_name: the name of the S3 bucket (the place inside it goes "
                             "in aws_data_prefix)")
        if bucket.startswith("s3://") or "/" in bucket or bucket != bucket.strip():
            name, _, rest = bucket.removeprefix("s3://").strip().partition("/")
            raise ValueError(f"aws_bucket_name {bucket!r} is not a bucket name; write the name alone "
                             f"(aws_bucket_name {name!r}" + (f", aws_data_prefix {rest!r})" if rest else ")"))
        if self.aws_data_prefix.startswith("s3://"):
            raise ValueError(f"aws_data_prefix {self.aws_data_prefix!r} is a URL; write the key prefix inside the "
                             "bucket (e.g. 'photos/cats'), the bucket goes in aws_bucket_name")
        if ".." in self.aws_data_prefix.strip("/").split("/"):
            raise ValueError(f"aws_data_prefix {self.aws_data_prefix!r} has a '..' part; S3 keys have no parent "
                             "folders: write the prefix as it appears in the keys")
        endpoint = self.aws_endpoint_url
        if endpoint and (not endpoint.startswith(("http://", "https://")) or len(endpoint.split("://", 1)[1]) == 0):
            raise ValueError(f"aws_endpoint_url {endpoint!r} is not an http(s) URL; write it as "
                             "https://host[:port] (e.g. http://localhost:9000 for MinIO), or remove it for AWS S3")
        for key in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            value = getattr(self, key) or ""
            if value.startswith("$") or "{env:" in value:  # real keys are base64/hex: never '$' or '{'
                raise ValueError(f"{key} looks like an environment variable placeholder, which difftune does not "
                                 "fill in; leave the credentials out of the entry and set AWS_ACCESS_KEY_ID and "
                                 "AWS_SECRET_ACCESS_KEY (boto3 reads them itself)")
        key_id, secret = aws_value_set(self.aws_access_key_id), aws_value_set(self.aws_secret_access_key)
        if key_id != secret:
            have, lack = ("aws_access_key_id", "aws_secret_access_key") if key_id else \
                ("aws_secret_access_key", "aws_access_key_id")
            raise ValueError(f"{have} is set but {lack} is not: set both, or neither to let boto3 find the "
                             "credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws)")
        if aws_value_set(self.aws_session_token) and not key_id:
            raise ValueError("aws_session_token goes with aws_access_key_id and aws_secret_access_key (temporary "
                             "credentials): set those too, or remove it")
        return self
