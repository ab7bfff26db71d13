{{/*
Chart name, truncated to the 63 characters a label value allows.
*/}}
{{- define "stock-ledger.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: <release>-<chart>, or the release name alone when it already contains the chart name.
*/}}
{{- define "stock-ledger.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stock-ledger.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: name and instance only. They are immutable on a Deployment, so nothing that changes between
releases (version, chart) may appear here. Every pod that is not a worker must NOT carry both of them: the
Deployment would adopt a bare pod that matches, the PodDisruptionBudget and PodMonitor would count it, and the
chaos drill (which kills pods by this selector) would kill it.
*/}}
{{- define "stock-ledger.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stock-ledger.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The selector as a kubectl label selector string (chaos drill).
*/}}
{{- define "stock-ledger.selectorString" -}}
app.kubernetes.io/name={{ include "stock-ledger.name" . }},app.kubernetes.io/instance={{ .Release.Name }}
{{- end }}

{{/*
The chart's own labels every object shares, apart from the selector pair.
*/}}
{{- define "stock-ledger.chartLabels" -}}
helm.sh/chart: {{ include "stock-ledger.chart" . }}
app.kubernetes.io/part-of: {{ include "stock-ledger.name" . }}
app.kubernetes.io/version: {{ include "stock-ledger.imageTag" . | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels every object and pod shares, apart from the selector pair: the chart's, then commonLabels (the schema keeps
them off the chart's own keys).
*/}}
{{- define "stock-ledger.commonLabels" -}}
{{ include "stock-ledger.chartLabels" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
An object's annotations: its own (`extra`, which win: hooks, sidecar folders) over commonAnnotations; nothing when
both are empty. Call with (dict "ctx" $ "extra" (dict ...)).
*/}}
{{- define "stock-ledger.annotations" -}}
{{- $all := merge (deepCopy (.extra | default dict)) (.ctx.Values.commonAnnotations | default dict) }}
{{- with $all }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels of the worker Deployment, its pods and the objects that describe them.
*/}}
{{- define "stock-ledger.labels" -}}
{{ include "stock-ledger.selectorLabels" . }}
{{ include "stock-ledger.commonLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{/*
Labels for the pods of hooks (migration, chaos): instance and component, deliberately without
app.kubernetes.io/name (see stock-ledger.selectorLabels). Call with (dict "ctx" $ "component" "migration").
*/}}
{{- define "stock-ledger.hookLabels" -}}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{ include "stock-ledger.commonLabels" .ctx }}
{{- end }}

{{- define "stock-ledger.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/*
An image reference [registry/]repository:tag, or [registry/]repository@digest (the digest wins when set); an
empty registry leaves the repository as written. Call with (dict "image" .Values.image "registry" "..." "ctx" $).
*/}}
{{- define "stock-ledger.imageRef" -}}
{{- $repository := .image.repository }}
{{- with .registry }}
{{- $repository = printf "%s/%s" . $repository }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repository .image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/*
The app image: workers, the migration hook, helm test, and the chaos drill's prepare Job and workers.
*/}}
{{- define "stock-ledger.image" -}}
{{- include "stock-ledger.imageRef" (dict "image" .Values.image "registry" (include "stock-ledger.registry" (dict "registry" .Values.image.registry "ctx" .)) "ctx" .) }}
{{- end }}

{{/*
The registry of an image: global.imageRegistry when a parent chart or the platform sets it (it wins, as in the
Bitnami charts: one value moves every image of every chart to a mirror), else the image's own. Call with
(dict "registry" "..." "ctx" $).
*/}}
{{- define "stock-ledger.registry" -}}
{{- $global := (.ctx.Values.global | default dict).imageRegistry | default "" }}
{{- default .registry $global }}
{{- end }}

{{/*
The chaos image defaults to the app image; it must also contain kubectl (see values.yaml, chaos.image). Its
registry defaults to image.registry.
*/}}
{{- define "stock-ledger.chaosImage" -}}
{{- if .Values.chaos.image.repository }}
{{- $registry := include "stock-ledger.registry" (dict "registry" (default .Values.image.registry .Values.chaos.image.registry) "ctx" .) }}
{{- include "stock-ledger.imageRef" (dict "image" .Values.chaos.image "registry" $registry "ctx" .) }}
{{- else }}
{{- include "stock-ledger.image" . }}
{{- end }}
{{- end }}

{{/*
The archive CronJob's image: the app image's repository with the tag <tag>-archive (what `make archive-image` and
`make release` build: pyarrow included), each part overridable in archive.image. Its registry defaults to
image.registry. Only archive.image.digest pins it: image.digest is the worker image's.
*/}}
{{- define "stock-ledger.archiveImage" -}}
{{- $a := .Values.archive.image }}
{{- $registry := include "stock-ledger.registry" (dict "registry" (default .Values.image.registry $a.registry) "ctx" .) }}
{{- $tag := default (printf "%s-archive" (include "stock-ledger.imageTag" .)) $a.tag }}
{{- $image := dict "repository" (default .Values.image.repository $a.repository) "tag" $tag "digest" $a.digest }}
{{- include "stock-ledger.imageRef" (dict "image" $image "registry" $registry "ctx" .) }}
{{- end }}

{{- define "stock-ledger.databaseSecret" -}}
{{- required "database.existingSecret is required: the name of an existing Secret holding the worker's DATABASE_URL" .Values.database.existingSecret }}
{{- end }}

{{/*
The migration hook's Secret: the owner role's DATABASE_URL. Never the worker's Secret as a fallback: the worker
role (a member of stock_ledger_app) has no DDL rights, so a hook run with it fails every install and upgrade.
*/}}
{{- define "stock-ledger.migrationSecret" -}}
{{- if not .Values.database.migrationSecret }}
{{- fail (printf `database.migrationSecret is required while migrations.enabled is true: the migration hook runs DDL as the database's OWNER role, which the worker's Secret (database.existingSecret) cannot. Create a Secret holding the owner role's URL, e.g.
  kubectl -n %s create secret generic stock-ledger-db-owner --from-literal=DATABASE_URL='postgresql://stock_ledger:...@db:5432/stock_ledger'
and set database.migrationSecret=stock-ledger-db-owner (database.migrationSecretKey if the key is not %s), or set migrations.enabled=false and run "stock-ledger migrate" as the owner yourself before each install or upgrade` .Release.Namespace .Values.database.secretKey) }}
{{- end }}
{{- .Values.database.migrationSecret }}
{{- end }}

{{/*
DATABASE_URL of the owner role (database.migrationSecret, key database.migrationSecretKey else database.secretKey):
the migration Job's, and the archive CronJob's (it detaches and drops partitions, DDL the worker role may not run).
Never the worker's Secret and key.
*/}}
{{- define "stock-ledger.ownerDatabaseUrlEnv" -}}
{{- $secret := include "stock-ledger.migrationSecret" . }}
{{- $key := default .Values.database.secretKey .Values.database.migrationSecretKey }}
{{- if and (eq $secret (include "stock-ledger.databaseSecret" .)) (eq $key .Values.database.secretKey) }}
{{- fail (printf "database.migrationSecret %q with key %q is the worker's Secret and key (database.existingSecret, database.secretKey): the worker role cannot run DDL. Point it at the owner role's DATABASE_URL (another Secret, or another key with database.migrationSecretKey)" $secret $key) }}
{{- end -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
{{- end }}

{{/*
DATABASE_URL from the existing Secret, never from values: the URL holds a password.
*/}}
{{- define "stock-ledger.databaseUrlEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "stock-ledger.databaseSecret" . }}
      key: {{ .Values.database.secretKey }}
{{- end }}

{{/*
Kafka and worker settings as STOCK_LEDGER_* variables. values.schema.json restricts .Values.config to the keys of
$names, so every key maps to a variable the worker reads. Whole numbers are printed as integers: Helm reads YAML
numbers as float64, which would otherwise print 1e+06.
*/}}
{{- define "stock-ledger.configEnv" -}}
{{- $names := dict
  "logLevel" "STOCK_LEDGER_LOG_LEVEL"
  "logFormat" "STOCK_LEDGER_LOG_FORMAT"
  "sessionTimeoutMs" "STOCK_LEDGER_SESSION_TIMEOUT_MS"
  "rebalanceTimeoutMs" "STOCK_LEDGER_REBALANCE_TIMEOUT_MS"
  "metadataMaxAgeMs" "STOCK_LEDGER_METADATA_MAX_AGE_MS"
  "batchMaxRecords" "STOCK_LEDGER_BATCH_MAX_RECORDS"
  "batchMaxWaitMs" "STOCK_LEDGER_BATCH_MAX_WAIT_MS"
  "autoOffsetReset" "STOCK_LEDGER_AUTO_OFFSET_RESET"
  "retryDeadlineSeconds" "STOCK_LEDGER_RETRY_DEADLINE_SECONDS"
  "lockTimeoutMs" "STOCK_LEDGER_LOCK_TIMEOUT_MS"
  "idleInTransactionTimeoutMs" "STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS"
  "databaseReplyTimeoutMs" "STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS"
  "shutdownGraceSeconds" "STOCK_LEDGER_SHUTDOWN_GRACE_SECONDS"
  "stallSeconds" "STOCK_LEDGER_STALL_SECONDS" -}}
- name: KAFKA_BOOTSTRAP_SERVERS
  value: {{ .Values.kafka.bootstrapServers | quote }}
- name: STOCK_LEDGER_TOPIC
  value: {{ .Values.kafka.topic | quote }}
- name: STOCK_LEDGER_GROUP_ID
  value: {{ .Values.kafka.groupId | quote }}
- name: STOCK_LEDGER_METRICS_PORT
  value: {{ .Values.metrics.port | int | quote }}
{{- range $key, $value := .Values.config }}
- name: {{ get $names $key }}
  value: {{ ternary (printf "%d" (int64 $value)) (toString $value) (kindIs "float64" $value) | quote }}
{{- end }}
{{- end }}

{{/*
The uid, gid and fsGroup every pod runs with, as JSON: podSecurityContext's, unless the deprecated securityContext
names one (it wins for one release: NOTES.txt says so). A key set to null is left to the platform (OpenShift's
restricted-v2 SCC assigns ids from the namespace's range). fsGroup defaults to the gid: it owns the mounted Secret
files (mode 0440), which a non-root uid could not read otherwise.
*/}}
{{- define "stock-ledger.ids" -}}
{{- $old := .Values.securityContext | default dict }}
{{- $new := .Values.podSecurityContext | default dict }}
{{- $ids := dict }}
{{- range $key := list "runAsUser" "runAsGroup" "fsGroup" }}
{{- if hasKey $old $key }}
{{- $_ := set $ids $key (get $old $key) }}
{{- else if hasKey $new $key }}
{{- $_ := set $ids $key (get $new $key) }}
{{- end }}
{{- end }}
{{- if not (hasKey $ids "fsGroup") }}
{{- $_ := set $ids "fsGroup" (get $ids "runAsGroup") }}
{{- end }}
{{- $set := dict }}
{{- range $key, $value := $ids }}
{{- if $value }}
{{- $_ := set $set $key (int64 $value) }}
{{- end }}
{{- end }}
{{- toJson $set }}
{{- end }}

{{/*
Security context of every pod of the chart: runAsNonRoot and RuntimeDefault seccomp, the ids above, and whatever
else podSecurityContext sets (supplementalGroups, seLinuxOptions, ...; the schema keeps runAsNonRoot true).
*/}}
{{- define "stock-ledger.podSecurityContext" -}}
{{- $own := omit (deepCopy (.Values.podSecurityContext | default dict)) "runAsUser" "runAsGroup" "fsGroup" }}
{{- $context := merge $own (dict "runAsNonRoot" true "seccompProfile" (dict "type" "RuntimeDefault")) }}
{{- toYaml (mergeOverwrite $context (include "stock-ledger.ids" . | fromJson)) }}
{{- end }}

{{/*
Security context of every container of the chart, and the default of each sidecar and init container (a field
the container sets wins): read-only root, no privilege escalation, every capability dropped, RuntimeDefault seccomp,
the pod's uid and gid, merged with containerSecurityContext (the schema keeps those restrictions).
*/}}
{{- define "stock-ledger.containerSecurityContext" -}}
{{- $chart := dict "runAsNonRoot" true "readOnlyRootFilesystem" true "allowPrivilegeEscalation" false "privileged" false "capabilities" (dict "drop" (list "ALL")) "seccompProfile" (dict "type" "RuntimeDefault") }}
{{- $ids := omit (include "stock-ledger.ids" . | fromJson) "fsGroup" }}
{{- toYaml (merge (deepCopy (.Values.containerSecurityContext | default dict)) $ids $chart) }}
{{- end }}

{{/*
Extra containers (sidecars, initContainers), each with the chart's container securityContext under its own.
Call with (dict "containers" .Values.sidecars "ctx" $).
*/}}
{{- define "stock-ledger.extraContainers" -}}
{{- $default := include "stock-ledger.containerSecurityContext" .ctx | fromYaml }}
{{- range .containers }}
{{- $container := deepCopy . }}
{{- $_ := set $container "securityContext" (merge (deepCopy ($container.securityContext | default dict)) $default) }}
- {{ toYaml $container | nindent 2 | trim }}
{{- end }}
{{- end }}

{{- define "stock-ledger.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{- define "stock-ledger.tmpVolumeMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
The archive CronJob and its claim. 52 characters at most: the CronJob controller appends an 11-character suffix to
name each Job, and Job names are labels (63).
*/}}
{{- define "stock-ledger.archiveName" -}}
{{- printf "%s-archive" (include "stock-ledger.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "stock-ledger.archiveClaim" -}}
{{- default (include "stock-ledger.archiveName" .) .Values.archive.persistence.existingClaim }}
{{- end }}

{{- define "stock-ledger.chaosName" -}}
{{- printf "%s-chaos" (include "stock-ledger.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* ---------------------------------------------------------------- connection security (docs/security.md) */}}

{{- define "stock-ledger.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stock-ledger.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
A read-only volume holding one file `path` from an existing Secret or ConfigMap.
Call with (dict "name" "kafka-ca" "secret" "..." "configMap" "..." "key" "ca.crt" "path" "ca.crt").
*/}}
{{- define "stock-ledger.fileVolume" -}}
- name: {{ .name }}
  {{- if .secret }}
  secret:
    secretName: {{ .secret }}
    defaultMode: 0440
  {{- else }}
  configMap:
    name: {{ .configMap }}
    defaultMode: 0444
  {{- end }}
    items:
      - key: {{ .key }}
        path: {{ .path }}
{{- end }}

{{- define "stock-ledger.kafkaSasl" -}}
{{- if hasPrefix "SASL_" .Values.kafka.security.protocol }}true{{ end }}
{{- end }}

{{- define "stock-ledger.kafkaTls" -}}
{{- if hasSuffix "SSL" .Values.kafka.security.protocol }}true{{ end }}
{{- end }}

{{/*
The ledger's role names (migrate grants to them; the others name them in a missing grant's advice) where they are
not the defaults; and, for the workers, how their URL pools sessions where it is not the default.
*/}}
{{- define "stock-ledger.databaseRolesEnv" -}}
{{- $roles := .Values.database.roles | default dict }}
{{- with $roles.app }}{{ if ne . "stock_ledger_app" }}
- name: STOCK_LEDGER_APP_ROLE
  value: {{ . | quote }}
{{- end }}{{ end }}
{{- with $roles.reader }}{{ if ne . "stock_ledger_reader" }}
- name: STOCK_LEDGER_READER_ROLE
  value: {{ . | quote }}
{{- end }}{{ end }}
{{- end }}

{{- define "stock-ledger.databasePoolingEnv" -}}
{{- if eq (.Values.database.pooling | default "session") "transaction" }}
- name: STOCK_LEDGER_DATABASE_POOLING
  value: "transaction"
{{- end }}
{{- end }}

{{/*
`helm test`'s DATABASE_URL: the workers' own, unless they go through a transaction pooler, where verify (which needs
a session of its own) reads the migration Secret's URL instead.
*/}}
{{- define "stock-ledger.testDatabaseUrlEnv" -}}
{{- if eq (.Values.database.pooling | default "session") "transaction" }}
{{- if not .Values.database.migrationSecret }}
{{- fail "database.pooling=transaction: helm test's verify needs a session of its own, which the workers' URL (a transaction pooler) cannot give: set database.migrationSecret to a Secret whose URL reaches PostgreSQL directly or through a session-mode pooler" }}
{{- end }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.migrationSecret }}
      key: {{ default .Values.database.secretKey .Values.database.migrationSecretKey }}
{{- else }}
{{- include "stock-ledger.databaseUrlEnv" . }}
{{- end }}
{{- end }}

{{- define "stock-ledger.databaseTlsEnv" -}}
{{- with .Values.database.sslmodeMin }}
- name: STOCK_LEDGER_DATABASE_SSLMODE_MIN
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{- define "stock-ledger.databaseCaVolume" -}}
{{- $ca := .Values.database.ca }}
{{- if or $ca.secretName $ca.configMapName }}
{{ include "stock-ledger.fileVolume" (dict "name" "database-ca" "secret" $ca.secretName "configMap" $ca.configMapName "key" $ca.key "path" "ca.crt") }}
{{- end }}
{{- end }}

{{- define "stock-ledger.databaseCaMount" -}}
{{- if or .Values.database.ca.secretName .Values.database.ca.configMapName }}
- name: database-ca
  mountPath: /etc/stock-ledger/database-ca
  readOnly: true
{{- end }}
{{- end }}

{{/*
KAFKA_SECURITY_PROTOCOL and what it needs; the password and the client key are files from existing Secrets.
*/}}
{{- define "stock-ledger.securityEnv" -}}
{{- $sec := .Values.kafka.security }}
- name: KAFKA_SECURITY_PROTOCOL
  value: {{ $sec.protocol | quote }}
{{- if include "stock-ledger.kafkaSasl" . }}
- name: KAFKA_SASL_MECHANISM
  value: {{ $sec.sasl.mechanism | quote }}
- name: KAFKA_SASL_USERNAME
  value: {{ $sec.sasl.username | quote }}
- name: KAFKA_SASL_PASSWORD_FILE
  value: /etc/stock-ledger/kafka-sasl/password
{{- end }}
{{- if include "stock-ledger.kafkaTls" . }}
{{- if or $sec.tls.ca.secretName $sec.tls.ca.configMapName }}
- name: KAFKA_SSL_CA_FILE
  value: /etc/stock-ledger/kafka-ca/ca.crt
{{- end }}
{{- if $sec.tls.clientCertSecret }}
- name: KAFKA_SSL_CERT_FILE
  value: /etc/stock-ledger/kafka-client/tls.crt
- name: KAFKA_SSL_KEY_FILE
  value: /etc/stock-ledger/kafka-client/tls.key
{{- end }}
- name: KAFKA_SSL_CHECK_HOSTNAME
  value: {{ $sec.tls.checkHostname | quote }}
{{- end }}
{{- include "stock-ledger.databaseTlsEnv" . }}
{{- end }}

{{- define "stock-ledger.securityVolumes" -}}
{{- $sec := .Values.kafka.security }}
{{- if include "stock-ledger.kafkaSasl" . }}
{{ include "stock-ledger.fileVolume" (dict "name" "kafka-sasl" "secret" $sec.sasl.passwordSecret.name "key" $sec.sasl.passwordSecret.key "path" "password") }}
{{- end }}
{{- if and (include "stock-ledger.kafkaTls" .) (or $sec.tls.ca.secretName $sec.tls.ca.configMapName) }}
{{ include "stock-ledger.fileVolume" (dict "name" "kafka-ca" "secret" $sec.tls.ca.secretName "configMap" $sec.tls.ca.configMapName "key" $sec.tls.ca.key "path" "ca.crt") }}
{{- end }}
{{- if and (include "stock-ledger.kafkaTls" .) $sec.tls.clientCertSecret }}
- name: kafka-client
  secret:
    secretName: {{ $sec.tls.clientCertSecret }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- include "stock-ledger.databaseCaVolume" . }}
{{- end }}

{{- define "stock-ledger.securityVolumeMounts" -}}
{{- $sec := .Values.kafka.security }}
{{- if include "stock-ledger.kafkaSasl" . }}
- name: kafka-sasl
  mountPath: /etc/stock-ledger/kafka-sasl
  readOnly: true
{{- end }}
{{- if and (include "stock-ledger.kafkaTls" .) (or $sec.tls.ca.secretName $sec.tls.ca.configMapName) }}
- name: kafka-ca
  mountPath: /etc/stock-ledger/kafka-ca
  readOnly: true
{{- end }}
{{- if and (include "stock-ledger.kafkaTls" .) $sec.tls.clientCertSecret }}
- name: kafka-client
  mountPath: /etc/stock-ledger/kafka-client
  readOnly: true
{{- end }}
{{- include "stock-ledger.databaseCaMount" . }}
{{- end }}

{{/*
The chaos drill's own workers: a different app.kubernetes.io/name, so nothing of the release's workers (the
Deployment, PDB, PodMonitor, helm test) ever selects them, and the drill never selects the release's workers.
*/}}
{{- define "stock-ledger.chaosWorkerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-chaos-drill" (include "stock-ledger.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stock-ledger.chaosWorkerSelectorString" -}}
app.kubernetes.io/name={{ printf "%s-chaos-drill" (include "stock-ledger.name" .) | trunc 63 | trimSuffix "-" }},app.kubernetes.io/instance={{ .Release.Name }}
{{- end }}

{{/*
The drill's topic. The same name at every render (Argo CD renders with `helm template`, where the release revision
is always 1): the prepare Job deletes and re-creates it before each drill, so a drill never reads an older one's
records. chaos.topicPrefix is the deprecated name of chaos.topic.
*/}}
{{- define "stock-ledger.chaosTopic" -}}
{{- default .Values.chaos.topic .Values.chaos.topicPrefix }}
{{- end }}

{{/*
Environment of every drill container: the drill's database, topic and group instead of the release's.
*/}}
{{- define "stock-ledger.chaosEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "chaos.database.existingSecret is required with chaos.enabled: a Secret with the URL of the drill's own database (dropped and re-created by each drill)" .Values.chaos.database.existingSecret }}
      key: {{ .Values.chaos.database.secretKey }}
- name: KAFKA_BOOTSTRAP_SERVERS
  value: {{ .Values.kafka.bootstrapServers | quote }}
- name: STOCK_LEDGER_TOPIC
  value: {{ include "stock-ledger.chaosTopic" . | quote }}
- name: STOCK_LEDGER_GROUP_ID
  value: {{ .Values.chaos.groupId | quote }}
- name: STOCK_LEDGER_LOG_FORMAT
  value: {{ default "json" .Values.config.logFormat | quote }}
{{- end }}

{{/*
Hook annotations of the drill's objects: created after install/upgrade in `weight` order, deleted when the drill
ends, pass or fail (Helm deletes the earlier hooks' hook-succeeded objects when a later hook fails). Argo CD runs
them as PostSync hooks in the same order (sync waves), after every sync.
Call with (dict "weight" "-10").
*/}}
{{- define "stock-ledger.chaosHook" -}}
helm.sh/hook: post-install,post-upgrade
helm.sh/hook-weight: {{ .weight | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
argocd.argoproj.io/hook: PostSync
argocd.argoproj.io/sync-wave: {{ .weight | quote }}
argocd.argoproj.io/hook-delete-policy: BeforeHookCreation,HookSucceeded
{{- end }}

{{/*
The read-only check's pod spec, shared by `helm test` (templates/tests/test-pod.yaml) and the Argo CD PostSync Job
(templates/verify-job.yaml, test.postSync): wait until the workers answer /readyz (files/readiness-check.py,
through the headless Service's DNS; no Kubernetes API access), then `stock-ledger verify --wait` read-only (no
--expect, no produce, no kills).
*/}}
{{- define "stock-ledger.verifyPodSpec" -}}
restartPolicy: Never
automountServiceAccountToken: false
enableServiceLinks: false
activeDeadlineSeconds: {{ .Values.test.activeDeadlineSeconds }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "stock-ledger.podSecurityContext" . | nindent 2 }}
initContainers:
  - name: ready
    image: {{ include "stock-ledger.image" . | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["python", "-c", {{ .Files.Get "files/readiness-check.py" | quote }}]
    env:
      - name: WORKERS_HOST
        value: {{ printf "%s-workers.%s.svc" (include "stock-ledger.fullname" .) .Release.Namespace | quote }}
      - name: WORKERS_PORT
        value: {{ .Values.metrics.port | int | quote }}
      - name: WORKERS_EXPECTED
        value: {{ ternary .Values.autoscaling.minReplicas .Values.replicaCount .Values.autoscaling.enabled | int | quote }}
      - name: READY_TIMEOUT_SECONDS
        value: {{ .Values.test.readyTimeoutSeconds | int | quote }}
    resources:
      {{- toYaml .Values.test.resources | nindent 6 }}
    securityContext:
      {{- include "stock-ledger.containerSecurityContext" . | nindent 6 }}
    volumeMounts:
      {{- include "stock-ledger.tmpVolumeMount" . | nindent 6 }}
containers:
  - name: verify
    image: {{ include "stock-ledger.image" . | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args: ["verify", "--wait", {{ .Values.test.verifyWaitSeconds | int | quote }}]
    env:
      {{- include "stock-ledger.testDatabaseUrlEnv" . | nindent 6 }}
      {{- include "stock-ledger.configEnv" . | nindent 6 }}
      {{- with include "stock-ledger.databaseRolesEnv" . | trim }}{{ . | nindent 6 }}{{- end }}
      {{- with include "stock-ledger.securityEnv" . | trim }}{{ . | nindent 6 }}{{- end }}
    resources:
      {{- toYaml .Values.test.resources | nindent 6 }}
    securityContext:
      {{- include "stock-ledger.containerSecurityContext" . | nindent 6 }}
    volumeMounts:
      {{- include "stock-ledger.tmpVolumeMount" . | nindent 6 }}
      {{- with include "stock-ledger.securityVolumeMounts" . | trim }}{{ . | nindent 6 }}{{- end }}
volumes:
  {{- include "stock-ledger.tmpVolume" . | nindent 2 }}
  {{- with include "stock-ledger.securityVolumes" . | trim }}{{ . | nindent 2 }}{{- end }}
{{- end }}

{{/*
A NetworkPolicy's egress rules (called with .Values.networkPolicy): nothing unless egress.restricted; then DNS, the
brokers, PostgreSQL and egress.extra.
*/}}
{{- define "stock-ledger.networkPolicyEgress" -}}
{{- $np := . }}
  {{- if $np.egress.restricted }}
  egress:
    # Name resolution: the brokers' advertised names and the database host.
    - ports:
        - protocol: UDP
          port: 53
        - protocol: TCP
          port: 53
      {{- with $np.egress.dnsTo }}
      to:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- range $name := list "kafka" "database" }}
    {{- $rule := get $np.egress $name }}
    # {{ $name }}
    - ports:
        {{- range $rule.ports }}
        - protocol: TCP
          port: {{ . }}
        {{- end }}
      {{- with $rule.to }}
      to:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
    {{- with $np.egress.extra }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
{{- end }}
