"""The generated CRDs pass what a real API server checks when they are applied, and each check works.

Mirrored offline by operator/crd_checks.py (`crd_errors`), with the API server's paths and wording
(apiextensions' CRD validation, structural schema validation, and the defaulting validation):
- metadata.name is `<plural>.<group>` and a DNS subdomain; spec.group a DNS subdomain with a dot; scope is
  Cluster or Namespaced; preserveUnknownFields is not true.
- names: plural, singular, kind, listKind are set; all, shortNames and categories are DNS-1035 labels (kind
  and listKind lowercased); kind differs from listKind.
- versions: unique DNS-1035 names, exactly one storage version, a schema for each.
- printer columns: name set; type one of integer/number/string/boolean/date; format one of the known
  ones; JSONPath set and a simple path starting with `.`; priority an integer. Scale subresource paths.
- schema root: with the status subresource, type object and only the keywords allowed at the root; not
  nullable; apiVersion/kind are strings; metadata an object that may restrict only name/generateName.
- structural schema: no $ref/definitions/dependencies/patternProperties/additionalItems/id; every node has
  a known type (unless int-or-string or preserve-unknown-fields); arrays have items (one schema);
  no uniqueItems; properties and additionalProperties are exclusive; preserve-unknown-fields is true or
  unset; int-or-string has no type; embedded-resource is an object with properties (or preserving
  unknown fields) and not inside metadata.
- x-kubernetes-map-type (on objects; atomic or granular); x-kubernetes-list-type (on arrays; atomic, set
  or map); list-map-keys only on map lists, non-empty, unique, naming scalar item properties that are
  required or defaulted and not nullable; set items scalar or atomic; set/map items not nullable.
- defaults: none in top-level apiVersion/kind/metadata nor in additionalProperties under metadata; every
  default AS WRITTEN (nested defaults not applied) is pruned ("must not have unknown fields"), passes the
  OpenAPI validation of its schema and every CEL rule in scope, with oldSelf bound to the default too.
- CEL rules: a rule is set; a message is non-blank and one line, and required for a multi-line rule;
  reason is a known one; fieldPath names a field; the rule parses; each name is declared and each field it
  selects exists in the schema (cel-go's "undefined field"); oldSelf only where old and new values
  correlate (not below a list that is not list-type map, nor an atomic map); optionalOldSelf only with
  oldSelf.

Not mirrored, and why:
- cel-go's type checker beyond field existence (overloads, int vs double, Kubernetes' CEL libraries we do
  not use): cel-python is dynamically typed. The rules are instead run on good and bad examples.
- CEL cost estimates (per rule and per CRD): they come from cel-go's cost model over the declared types;
  `project_problems` approximates them by requiring maxLength/maxItems/maxProperties everywhere.
- RE2 semantics of `pattern` (Python's re runs here), and `format` checks other than date and date-time.
- Defaults under the metadata of an x-kubernetes-embedded-resource (the API server coerces them into
  ObjectMeta and validates that); we have no embedded resources, and top-level metadata takes none.
- What depends on the cluster or an old object: immutable group/plural/scope/kind once Established,
  status.storedVersions, ratcheting of unchanged schemas, name conflicts with other CRDs (NamesAccepted),
  the api-approved annotation of *.k8s.io groups, conversion webhooks.

Stricter than the API server (`project_problems`, plus refusing anyOf/allOf/oneOf/not outright): bounded
strings, lists and maps; patterns without look-around or back-references (RE2 has neither); has() before
every optional field a rule reads; defaults written out in full; printer columns naming an existing field
of a fitting type; status subresource iff a status.
"""

from __future__ import annotations

import copy

import pytest
from modelfleet.operator import crd_checks, crdgen, schema_checks

ISSUE_MESSAGE = (
    "spec.validation.openAPIV3Schema.properties[spec].properties[replicas].default: "
    'Invalid value: "object": no such key: min evaluating rule: min must be <= max'
)


@pytest.mark.parametrize("kind", ["InferenceModel", "ModelVersion"])
def test_generated_crds_pass_every_api_server_check(crd_files, kind):
    assert [str(e) for e in crd_checks.crd_errors(crd_files[kind])] == []


@pytest.mark.parametrize("kind", ["InferenceModel", "ModelVersion"])
def test_generated_crds_keep_the_project_rules(crd_files, kind):
    assert crd_checks.project_problems(crd_files[kind]) == []


def test_object_defaults_are_written_out_and_valid_as_written(schemas):
    """The API server validates `replicas.default` as written: it must hold min and max itself."""
    spec = schemas["InferenceModel"]["properties"]["spec"]["properties"]
    assert spec["replicas"]["default"] == {"min": 1, "max": 1}
    assert spec["routing"]["default"] == {"stickyBy": "none"}
    assert spec["rollout"]["properties"]["thresholds"]["default"] == {"maxErrorRate": 0.01}


def test_the_crd_of_the_issue_is_refused_with_the_api_servers_message(crd_files):
    """The CRD a real API server refused: `default: {}` under the unguarded `self.min <= self.max`."""
    crd = copy.deepcopy(crd_files["InferenceModel"])
    replicas = _props(crd)["spec"]["properties"]["replicas"]
    replicas["default"] = {}
    replicas["x-kubernetes-validations"] = [{"rule": "self.min <= self.max", "message": "min must be <= max"}]
    with pytest.raises(schema_checks.Invalid) as caught:
        crd_checks.check_crd(crd)
    assert (
        str(caught.value)
        == f'The CustomResourceDefinition "inferencemodels.modelfleet.dev" is invalid: {ISSUE_MESSAGE}'
    )
    problems = crd_checks.project_problems(crd)
    assert "spec.replicas: rule 'self.min <= self.max' reads optional self.min without has()" in problems
    assert any("default {} leaves out nested defaults" in p for p in problems)


def _props(crd):
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]


def _spec(crd):
    return _props(crd)["spec"]["properties"]


def _set(path, value):
    def mutate(crd):
        node = crd
        *parents, last = path
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


def _spec_set(field, key, value):
    return lambda crd: _spec(crd)[field].__setitem__(key, value)


SCHEMA = "spec.validation.openAPIV3Schema"
REPLICAS = f"{SCHEMA}.properties[spec].properties[replicas]"
TRAFFIC = f"{SCHEMA}.properties[spec].properties[traffic]"

# (what is wrong, how to break the InferenceModel CRD, the error the API server gives)
BROKEN = [
    ("name", _set(["metadata", "name"], "models.modelfleet.dev"), 'must be spec.names.plural+"."+spec.group'),
    (
        "group",
        _set(["spec", "group"], "modelfleet"),
        'spec.group: Invalid value: "modelfleet": should be a domain',
    ),
    ("scope", _set(["spec", "scope"], "Global"), 'spec.scope: Unsupported value: "Global"'),
    (
        "short name",
        _set(["spec", "names", "shortNames"], ["Im"]),
        'spec.names.shortNames[0]: Invalid value: "Im"',
    ),
    ("category", _set(["spec", "names", "categories"], ["model_fleet"]), "spec.names.categories[0]: Invalid"),
    (
        "kind is listKind",
        _set(["spec", "names", "listKind"], "InferenceModel"),
        "kind and listKind may not be",
    ),
    (
        "two storage versions",
        lambda crd: crd["spec"]["versions"].append({**crd["spec"]["versions"][0], "name": "v1beta1"}),
        "spec.versions: Invalid value: must have exactly one version marked as storage version",
    ),
    (
        "column type",
        lambda crd: crd["spec"]["versions"][0]["additionalPrinterColumns"][0].update(type="enum"),
        'spec.additionalPrinterColumns[0].type: Invalid value: "enum": must be one of boolean,date,integer',
    ),
    (
        "column path",
        lambda crd: crd["spec"]["versions"][0]["additionalPrinterColumns"][0].update(jsonPath="spec.x"),
        'JSONPath: Invalid value: "spec.x": must be a simple json path starting with .',
    ),
    (
        "column priority",
        lambda crd: crd["spec"]["versions"][0]["additionalPrinterColumns"][0].update(priority="1"),
        'spec.additionalPrinterColumns[0].priority: Invalid value: "1"',
    ),
    (
        "root type",
        _set(["spec", "versions", 0, "schema", "openAPIV3Schema", "type"], "array"),
        'only "object"',
    ),
    ("anyOf", _spec_set("engine", "anyOf", [{"required": ["maxNumSeqs"]}]), "anyOf: Forbidden"),
    ("$ref", _spec_set("engine", "$ref", "#/x"), "properties[engine].$ref: Forbidden: $ref is not supported"),
    (
        "no type",
        lambda crd: _spec(crd)["engine"].pop("type"),
        "engine].type: Required value: must not be empty",
    ),
    ("array items", lambda crd: _spec(crd)["traffic"].pop("items"), f"{TRAFFIC}.items: Required value"),
    ("uniqueItems", _spec_set("traffic", "uniqueItems", True), "uniqueItems: Forbidden"),
    (
        "properties and additionalProperties",
        _spec_set("engine", "additionalProperties", {"type": "string"}),
        "additionalProperties: Forbidden: additionalProperties and properties are mutual exclusive",
    ),
    (
        "preserve false",
        _spec_set("engine", "x-kubernetes-preserve-unknown-fields", False),
        "must be true or undefined",
    ),
    (
        "int-or-string typed",
        _spec_set("engine", "x-kubernetes-int-or-string", True),
        "must be empty if x-kubernetes-int",
    ),
    (
        "embedded resource",
        lambda crd: _spec(crd).update(
            pod={"type": "string", "maxLength": 9, "x-kubernetes-embedded-resource": True}
        ),
        "must be object if x-kubernetes-embedded-resource is true",
    ),
    (
        "map type on array",
        _spec_set("traffic", "x-kubernetes-map-type", "atomic"),
        "must be object if x-kubernetes-map",
    ),
    (
        "list type",
        _spec_set("traffic", "x-kubernetes-list-type", "bag"),
        'list-type: Unsupported value: "bag"',
    ),
    (
        "list map key optional",
        lambda crd: _spec(crd)["traffic"]["items"]["required"].remove("version"),
        "properties[version].default: Required value: this property is in x-kubernetes-list-map-keys",
    ),
    (
        "list map key missing",
        _spec_set("traffic", "x-kubernetes-list-map-keys", ["name"]),
        "entries must all be names of item properties",
    ),
    (
        "map keys on a set",
        _spec_set("traffic", "x-kubernetes-list-type", "set"),
        "must be map if x-kubernetes-list-map",
    ),
    (
        "set of objects",
        lambda crd: _spec(crd)["hardware"]["properties"]["tolerations"].update(
            {"x-kubernetes-list-type": "set"}
        ),
        "tolerations].items.x-kubernetes-map-type: Invalid value: null: must be atomic",
    ),
    (
        "default in metadata",
        _set(["spec", "versions", 0, "schema", "openAPIV3Schema", "properties", "metadata", "default"], {}),
        f"{SCHEMA}.properties[metadata].default: Forbidden: must not be set in top-level metadata",
    ),
    (
        "metadata fields",
        lambda crd: _props(crd)["metadata"].update(properties={"labels": {"type": "object"}}),
        "other than name",
    ),
    (
        "default unknown field",
        _spec_set("replicas", "default", {"min": 1, "max": 1, "x": 1}),
        "must not have unknown fields",
    ),
    (
        "default type",
        _spec_set("replicas", "default", {"min": "1", "max": 1}),
        f"{REPLICAS}.default.min: Invalid value",
    ),
    (
        "default breaks a rule",
        _spec_set("replicas", "default", {"min": 3, "max": 2}),
        f'{REPLICAS}.default: Invalid value: "object": min must be <= max',
    ),
    (
        "rule parse error",
        _spec_set("replicas", "x-kubernetes-validations", [{"rule": "self.min <=", "message": "m"}]),
        'x-kubernetes-validations[0].rule: Invalid value: apiextensions.ValidationRule{Rule:"self.min <="',
    ),
    (
        "rule reads a field that does not exist",
        _spec_set("replicas", "x-kubernetes-validations", [{"rule": "has(self.max) && self.maximum > 0"}]),
        "compilation failed: ERROR: <input>:1:22: undefined field 'maximum'",
    ),
    (
        "rule on an undeclared name",
        _spec_set("replicas", "x-kubernetes-validations", [{"rule": "other.min > 0"}]),
        "undeclared reference to 'other'",
    ),
    (
        "oldSelf below an atomic list",
        lambda crd: _spec(crd)["rollout"]["properties"]["steps"]["items"].update(
            {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "immutable"}]}
        ),
        "oldSelf cannot be used on the uncorrelatable portion of the schema within "
        f"{SCHEMA}.properties[spec].properties[rollout].properties[steps]",
    ),
    (
        "optionalOldSelf without oldSelf",
        lambda crd: _spec(crd)["traffic"]["x-kubernetes-validations"][0].update(optionalOldSelf=True),
        "optionalOldSelf: Invalid value: true: may not be set if oldSelf is not used in rule",
    ),
    (
        "multi-line message",
        lambda crd: _spec(crd)["traffic"]["x-kubernetes-validations"][0].update(message="weights\nsum"),
        "message must not contain line breaks",
    ),
    (
        "reason",
        lambda crd: _spec(crd)["traffic"]["x-kubernetes-validations"][0].update(reason="Bad"),
        'reason: Unsupported value: "Bad"',
    ),
    (
        "field path",
        lambda crd: _spec(crd)["traffic"]["x-kubernetes-validations"][0].update(fieldPath=".weights"),
        'fieldPath: Invalid value: ".weights": fieldPath must be a valid path',
    ),
]


@pytest.mark.parametrize(("case", "mutate", "expected"), BROKEN, ids=[case for case, *_ in BROKEN])
def test_each_check_catches_what_the_api_server_refuses(case, mutate, expected):
    crd = crdgen.inference_model_crd()
    mutate(crd)
    errors = [str(e) for e in crd_checks.crd_errors(crd)]
    assert any(expected in e for e in errors), errors


PROJECT_BROKEN = [
    (
        "look-ahead in a pattern",
        lambda crd: _spec(crd)["routing"]["properties"]["stickyBy"].update(pattern="^(?!x).*$"),
        "spec.routing.stickyBy: pattern needs look-around",
    ),
    (
        "unbounded string",
        lambda crd: _spec(crd)["routing"]["properties"]["stickyBy"].pop("maxLength"),
        "string without maxLength",
    ),
    (
        "unbounded list",
        lambda crd: _spec(crd)["traffic"].pop("maxItems"),
        "spec.traffic: array without maxItems",
    ),
    (
        "no status subresource",
        lambda crd: crd["spec"]["versions"][0].pop("subresources"),
        "status subresource",
    ),
    (
        "column on a missing field",
        lambda crd: crd["spec"]["versions"][0]["additionalPrinterColumns"][0].update(jsonPath=".spec.gpu"),
        "'Accelerator': .spec.gpu names no field of the schema",
    ),
    (
        "integer column on a string",
        lambda crd: crd["spec"]["versions"][0]["additionalPrinterColumns"][0].update(type="integer"),
        "integer column on a string field",
    ),
    (
        "partial default that breaks a rule once filled in",
        _spec_set("replicas", "default", {"min": 2}),
        'once defaulted: spec.replicas.default: Invalid value: "object": min must be <= max',
    ),
]


@pytest.mark.parametrize(("case", "mutate", "expected"), PROJECT_BROKEN, ids=[c for c, *_ in PROJECT_BROKEN])
def test_each_project_rule_catches_its_case(case, mutate, expected):
    crd = crdgen.inference_model_crd()
    mutate(crd)
    problems = crd_checks.project_problems(crd)
    assert any(expected in p for p in problems), problems


def test_has_guards_are_followed_through_and_or_and_ternaries():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
        "required": ["c"],
    }
    guarded = [
        "!has(self.a) || self.a > 0",
        "has(self.a) && has(self.b) && self.a < self.b",
        "has(self.a) ? self.a > self.c : true",
        "!has(self.a) ? true : self.a > 0",
        "!(has(self.a) && has(self.b)) || self.a < self.b",
        "self.c > 0",
    ]
    for rule in guarded:
        assert crd_checks.check_rule(schema, rule).unguarded == [], rule
    assert crd_checks.check_rule(schema, "has(self.a) || self.a > 0").unguarded == ["self.a"]
    assert crd_checks.check_rule(schema, "has(self.a) ? true : self.b > 0").unguarded == ["self.b"]


def test_macros_bind_their_variable_to_the_list_items(schemas):
    traffic = schemas["InferenceModel"]["properties"]["spec"]["properties"]["traffic"]
    assert crd_checks.check_rule(traffic, "self.all(t, t.weight >= 0)").error == ""
    assert "undefined field 'wieght'" in crd_checks.check_rule(traffic, "self.all(t, t.wieght >= 0)").error
    assert crd_checks.check_rule(traffic, "self.size() > 0 && self.map(t, t.weight).sum() == 100").error == ""
